//! Gradient sums overlapped with the backward pass: the gradient buffer in
//! buckets ([`ramus_exec::bucket`]) in the order the batched engine's
//! backward pass finishes the parameters' gradients, each bucket summed
//! over the ranks on a side stream as soon as its last gradient is in,
//! while the pass goes on; the update waits for the last sum.
//!
//! The backward pass adds each parameter gradient to the buffer right
//! after the step that finishes it, on that step's lane: the head's
//! steps, and a vertex function's eager steps (a CNN, whose image is one
//! vertex, runs all its layers there, last first). Gradients a vertex
//! function's per-task or lazy steps write are complete after its lazy
//! phase, once the tree's levels are done. An engine whose backward pass
//! does not report (the swap path) sums every bucket after it.

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream};
use ramus_core::Model;
use ramus_exec::data_parallel::{Collective, DeviceBuffer, GradBuffer};
use ramus_exec::Range;

use crate::batch::GraphBufs;
use crate::error::{model_err, CudaError, InCall, Result};
use crate::launch::RowMove;
use crate::pool::DeviceView;
use crate::program::GraphProgram;

use super::{CudaEngine, Lane};

mod order;

use order::SideLane;
pub(crate) use order::{grad_param, GradOrder, SumTimes, SumsSetup};

/// One batch's gradients being summed over the ranks (the last batch of a
/// step): which buckets are done.
pub(crate) struct GradSums {
    order: Arc<GradOrder>,
    /// The batch's share of the step's head rows, applied by the sum.
    scale: f32,
    /// The step's earlier batches, already scaled (gradients, then the
    /// loss): added to each bucket before its sum, which then scales by 1.
    accumulated: Option<DeviceView<f32>>,
    /// The rows of each embedding table the step's update touches (on
    /// the device): all a table's sum needs.
    rows: Vec<(usize, DeviceView<u32>)>,
    /// Gradient outputs still to come, per parameter.
    left: Vec<usize>,
    fired: usize,
}

/// The sums of a backward pass under way, with the group they go to.
pub(crate) struct Overlap<'a> {
    pub sums: &'a mut GradSums,
    pub collective: &'a mut dyn Collective<f32>,
}

/// A phase of a graph's program, as [`CudaEngine::run_steps`] runs it.
#[derive(Clone, Copy)]
pub(crate) struct PhaseRun<'a> {
    pub bufs: GraphBufs<'a>,
    pub prog: &'a GraphProgram,
    pub phase: usize,
    pub range: Range,
    /// The vertex function (`None`: the head).
    pub f: Option<usize>,
    pub lane: &'a Lane,
}

impl CudaEngine {
    /// The sums of a batch whose rows are `scale` of the step's, with the
    /// step's earlier batches in `accumulated` (gradients, then the loss)
    /// and the rows of each table the step touches; the side lane and the
    /// gradient order made on first use.
    pub(crate) fn grad_sums(
        &mut self,
        model: &Model,
        (scale, accumulated): (f32, Option<DeviceView<f32>>),
        rows: &[(usize, DeviceView<u32>)],
    ) -> Result<GradSums> {
        if self.sums.lane.is_none() {
            let views = self.param_views()?;
            let cap = self.sums.bucket_bytes;
            let grads = (&views.grads[..], views.grad_all);
            let order = GradOrder::new(model, &self.program, grads, cap)?;
            let timed = || {
                let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
                self.device
                    .context()
                    .new_event(flags)
                    .in_call("cuEventCreate")
            };
            self.sums.lane = Some(SideLane {
                order: Arc::new(order),
                stream: self.device.new_stream()?,
                ready: self.device.new_event()?,
                eager_tail: self.device.new_event()?,
                first_sum: timed()?,
                backward_done: timed()?,
                summed: timed()?,
            });
        }
        self.read_sum_times()?;
        let order = self.side_lane()?.order.clone();
        Ok(GradSums {
            left: order.outputs_of.clone(),
            order,
            scale,
            accumulated,
            rows: rows.to_vec(),
            fired: 0,
        })
    }

    fn side_lane(&self) -> Result<&SideLane> {
        self.sums
            .lane
            .as_ref()
            .ok_or_else(|| model_err("gradient sums without a side lane"))
    }

    /// Sums bucket `k` of `sums` on the side lane once `lane` has written
    /// it, the step's earlier batches added (on `lane`). The main lane
    /// first joins the eager lane, which may have written a part.
    fn sum_bucket(
        &self,
        sums: &GradSums,
        k: usize,
        c: &mut dyn Collective<f32>,
        lane: &Lane,
    ) -> Result<()> {
        let side = self.side_lane()?;
        if std::ptr::eq(lane, &self.main) {
            side.eager_tail
                .record(&self.eager.stream)
                .in_call("cuEventRecord")?;
            lane.stream
                .wait(&side.eager_tail)
                .in_call("cuStreamWaitEvent")?;
        }
        let grad_all = self.param_views()?.grad_all;
        let span = |at: usize, len: usize| grad_all.slice(at..at + len).map(|v| (at, v));
        let mut spans = (sums.order.spans[k].iter())
            .map(|&(at, len)| span(at, len))
            .collect::<Result<Vec<_>>>()?;
        let tables = (sums.order.tables[k].iter())
            .map(|t| Ok((*t, span(t.at, t.len)?.1)))
            .collect::<Result<Vec<_>>>()?;
        let whole = tables.iter().map(|&(t, v)| (t.at, v));
        let written: Vec<_> = spans.iter().copied().chain(whole).collect();
        self.add_accumulated(sums, &written, &lane.stream)?;
        // each table's touched rows, gathered (a table the plan has no rows
        // for is summed whole)
        let mut gathered = Vec::new();
        for (t, table) in tables {
            match sums.rows.iter().find(|(p, _)| *p == t.param) {
                Some(&(_, rows)) if rows.is_empty() => {}
                Some(&(_, rows)) => {
                    let what = || format!("the touched rows of parameter {}", t.param);
                    let compact = self.arena_alloc::<f32>(rows.len() * t.width, &what)?;
                    let gather = RowMove::gather(compact, table, rows, t.width);
                    self.launcher.move_rows(&lane.stream, &[gather])?;
                    gathered.push((t, table, rows, compact));
                }
                None => spans.push((t.at, table)),
            }
        }
        side.ready.record(&lane.stream).in_call("cuEventRecord")?;
        side.stream.wait(&side.ready).in_call("cuStreamWaitEvent")?;
        if k == 0 {
            side.first_sum
                .record(&side.stream)
                .in_call("cuEventRecord")?;
        }
        let compacts = gathered.iter().map(|g| g.3);
        let buffers = (spans.iter().map(|&(_, v)| v).chain(compacts))
            .map(|v| on_stream(v, &side.stream))
            .collect();
        c.sum_buffers(buffers, f64::from(sums.sum_scale()))
            .map_err(|e| CudaError::Nccl(e.to_string()))?;
        let scatter: Vec<RowMove> = (gathered.into_iter())
            .map(|(t, table, rows, compact)| RowMove::scatter(table, compact, rows, t.width))
            .collect();
        self.launcher.move_rows(&side.stream, &scatter)
    }

    /// Adds the step's earlier batches to `spans` (offsets in the
    /// accumulator) after scaling them to their share, on `stream`.
    fn add_accumulated(
        &self,
        sums: &GradSums,
        spans: &[(usize, DeviceView<f32>)],
        stream: &CudaStream,
    ) -> Result<()> {
        if let Some(acc) = sums.accumulated {
            for &(at, v) in spans {
                let earlier = acc.slice(at..at + v.len())?;
                (self.launcher).scale_add(stream, (v, sums.scale), (earlier, 1.0))?;
            }
        }
        Ok(())
    }

    /// Sums every bucket not summed yet and the loss in `slot`, and makes
    /// the main lane wait for the sums.
    pub(crate) fn finish_sums(
        &self,
        mut sums: GradSums,
        slot: DeviceView<f32>,
        c: &mut dyn Collective<f32>,
    ) -> Result<()> {
        let side = self.side_lane()?;
        let main = &self.main.stream;
        side.backward_done.record(main).in_call("cuEventRecord")?;
        while sums.fired < sums.order.buckets.len() {
            self.sum_bucket(&sums, sums.fired, c, &self.main)?;
            sums.fired += 1;
        }
        let n = self.param_views()?.grad_all.len();
        self.add_accumulated(&sums, &[(n, slot)], main)?;
        side.ready.record(main).in_call("cuEventRecord")?;
        side.stream.wait(&side.ready).in_call("cuStreamWaitEvent")?;
        if sums.order.buckets.is_empty() {
            side.first_sum
                .record(&side.stream)
                .in_call("cuEventRecord")?;
        }
        let scale = f64::from(sums.sum_scale());
        c.sum_buffers(vec![on_stream(slot, &side.stream)], scale)
            .map_err(|e| CudaError::Nccl(e.to_string()))?;
        side.summed.record(&side.stream).in_call("cuEventRecord")?;
        self.sums.unread.set(true);
        main.wait(&side.summed).in_call("cuStreamWaitEvent")
    }

    /// Adds the last step's sum times, if not read yet, to the totals
    /// (waiting for its sums: called once a later step's forward pass has
    /// waited for them, or for a report).
    fn read_sum_times(&mut self) -> Result<()> {
        let Some(side) = self.sums.lane.as_ref().filter(|_| self.sums.unread.get()) else {
            return Ok(());
        };
        let ms = |a: &CudaEvent, b: &CudaEvent| a.elapsed_ms(b).in_call("cuEventElapsedTime");
        let span = ms(&side.first_sum, &side.summed)?;
        let exposed = ms(&side.backward_done, &side.summed)?.max(0.0);
        let times = &mut self.sums.times;
        times.steps += 1;
        times.span_ms += f64::from(span);
        times.exposed_ms += f64::from(exposed);
        self.sums.unread.set(false);
        Ok(())
    }

    /// The gradient sums' times since the last call (the count starts again).
    pub(crate) fn take_sum_times(&mut self) -> Result<SumTimes> {
        self.read_sum_times()?;
        Ok(std::mem::take(&mut self.sums.times))
    }
}

impl CudaEngine {
    /// Runs a phase as [`CudaEngine::run_steps`] does; before step `i`
    /// (and after the last) adds the gradient outputs `after[i]` lists, on
    /// the phase's lane, and reports them to `overlap`.
    pub(crate) fn run_reporting(
        &self,
        run: PhaseRun<'_>,
        after: &[Vec<usize>],
        overlap: &mut Overlap<'_>,
    ) -> Result<()> {
        let topo = run.f.map(|f| self.topology(f)).transpose()?;
        let steps = run.prog.phases.get(run.phase).map_or(&[][..], |p| &p[..]);
        for i in 0..=steps.len() {
            if let Some(step) = i.checked_sub(1).map(|k| &steps[k]) {
                let views = &run.prog.views;
                self.run_step(run.bufs, step, run.range, topo, run.lane, views)?;
            }
            for &o in after.get(i).map_or(&[][..], |o| &o[..]) {
                let out = &run.bufs.g.outputs[o];
                self.accumulate_output(run.bufs, out, run.range, topo, &run.lane.stream)?;
                if let Some(p) = grad_param(out) {
                    overlap.arrived(self, p, run.lane)?;
                }
            }
        }
        Ok(())
    }
}

impl GradSums {
    /// The gradient order the sums follow.
    pub(crate) fn order(&self) -> Arc<GradOrder> {
        self.order.clone()
    }

    /// The scale the sums apply (1 once the earlier batches were added in
    /// at this batch's share).
    fn sum_scale(&self) -> f32 {
        match self.accumulated {
            Some(_) => 1.0,
            None => self.scale,
        }
    }
}

impl Overlap<'_> {
    /// Parameter `p`'s gradient output is in the buffer (written on
    /// `lane`): sums the buckets whose gradients are all in, in bucket
    /// order.
    pub(crate) fn arrived(&mut self, e: &CudaEngine, p: usize, lane: &Lane) -> Result<()> {
        let sums = &mut *self.sums;
        if let Some(left) = sums.left.get_mut(p) {
            *left = left.saturating_sub(1);
        }
        while let Some(params) = sums.order.buckets.get(sums.fired) {
            if params.iter().any(|&q| sums.left[q] > 0) {
                break;
            }
            e.sum_bucket(sums, sums.fired, &mut *self.collective, lane)?;
            sums.fired += 1;
        }
        Ok(())
    }
}

/// `v` as a buffer whose writes are ordered on `stream`.
fn on_stream(v: DeviceView<f32>, stream: &CudaStream) -> GradBuffer<'static, f32> {
    GradBuffer::Device(DeviceBuffer {
        ptr: v.device_ptr(),
        len: v.len(),
        stream: stream.cu_stream() as u64,
    })
}
