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

use cudarc::driver::{CudaEvent, CudaStream};
use ramus_core::graph::{Graph, NodeId, Role};
use ramus_core::Model;
use ramus_exec::bucket::{self, DEFAULT_BUCKET_BYTES};
use ramus_exec::data_parallel::{Collective, DeviceBuffer, GradBuffer};

use ramus_exec::Range;

use crate::batch::GraphBufs;
use crate::error::{model_err, CudaError, InCall, Result};
use crate::pool::DeviceView;
use crate::program::{GraphProgram, PlannedStep, Program, EAGER};

use super::{CudaEngine, DeviceParams, Lane};

/// Where the backward pass finishes each parameter's gradient, and the
/// buckets in that order: fixed for a model.
pub(crate) struct GradOrder {
    /// Indexed by the steps of the head's backward program run before
    /// (0 to all of them): the head's gradient outputs added then.
    head_after: Vec<Vec<usize>>,
    /// Per vertex function, the same over its backward program's eager
    /// steps.
    eager_after: Vec<Vec<Vec<usize>>>,
    /// Per vertex function, its other gradient outputs: added after its
    /// lazy steps.
    lazy: Vec<Vec<usize>>,
    /// Gradient outputs per parameter over every backward graph.
    outputs_of: Vec<usize>,
    /// Parameters per bucket, in the order the buckets fill.
    buckets: Vec<Vec<usize>>,
    /// Each bucket's spans of the gradient buffer (offset, floats), its
    /// parameters' gradients merged where adjacent.
    spans: Vec<Vec<(usize, usize)>>,
}

/// How an engine sums its gradients over the ranks: the bucket size, and
/// the side lane once made.
pub(crate) struct SumsSetup {
    bucket_bytes: usize,
    lane: Option<SideLane>,
}

impl SumsSetup {
    pub(crate) fn new(bucket_bytes: Option<usize>) -> Self {
        SumsSetup {
            bucket_bytes: bucket_bytes.unwrap_or(DEFAULT_BUCKET_BYTES),
            lane: None,
        }
    }
}

/// The side stream the sums run on, and the events that hand over to it
/// and back.
struct SideLane {
    order: Arc<GradOrder>,
    stream: Arc<CudaStream>,
    ready: CudaEvent,
    /// Where the main lane joins the eager lane before a bucket it sums.
    eager_tail: CudaEvent,
    summed: CudaEvent,
}

/// One batch's gradients being summed over the ranks (the last batch of a
/// step): which buckets are done.
pub(crate) struct GradSums {
    order: Arc<GradOrder>,
    /// The batch's share of the step's head rows, applied by the sum.
    scale: f32,
    /// The step's earlier batches, already scaled (gradients, then the
    /// loss): added to each bucket before its sum, which then scales by 1.
    accumulated: Option<DeviceView<f32>>,
    /// Gradient outputs still to come, per parameter.
    left: Vec<usize>,
    fired: usize,
}

/// The sums of a backward pass under way, with the group they go to.
pub(crate) struct Overlap<'a> {
    pub sums: &'a mut GradSums,
    pub collective: &'a mut dyn Collective<f32>,
}

/// The parameter whose gradient output `o` is.
pub(crate) fn grad_param(o: &ramus_core::graph::Output) -> Option<usize> {
    match o.role {
        Role::ParamGrad(p) | Role::ParamRowGrad(p) => Some(p),
        _ => None,
    }
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

/// Whether `step` writes node `n`.
fn writes(step: &PlannedStep, n: NodeId) -> bool {
    let in_group = |g: &ramus_core::fusion::FusedGroup| {
        g.nodes.contains(&n) || g.concat_writes.iter().any(|w| w.concat == n)
    };
    match step {
        PlannedStep::Op(m) => *m == n,
        PlannedStep::Fused(group) => in_group(group),
        PlannedStep::GemmBias { matmul, group, .. } => *matmul == n || in_group(group),
    }
}

/// The last step of `prog` that writes node `n` (a slice without a step:
/// its source), as (phase, step).
fn last_writer(prog: &GraphProgram, mut n: NodeId) -> Option<(usize, usize)> {
    while let Some(view) = prog.views.get(&n) {
        n = view.source;
    }
    (0..prog.phases.len()).rev().find_map(|phase| {
        let steps = &prog.phases[phase];
        let step = steps.iter().rposition(|s| writes(&s.step, n))?;
        Some((phase, step))
    })
}

/// The gradient outputs of `g` by the steps of `prog`'s phase `phase` run
/// before they are final (index 0 to all of them), and those finished in
/// no step of that phase.
fn finished_in(g: &Graph, prog: &GraphProgram, phase: usize) -> (Vec<Vec<usize>>, Vec<usize>) {
    let steps = prog.phases.get(phase).map_or(0, |p| p.len());
    let mut after = vec![Vec::new(); steps + 1];
    let mut elsewhere = Vec::new();
    for (i, o) in g.outputs.iter().enumerate() {
        if grad_param(o).is_none() {
            continue;
        }
        match last_writer(prog, o.node) {
            Some((p, step)) if p == phase => after[step + 1].push(i),
            _ => elsewhere.push(i),
        }
    }
    (after, elsewhere)
}

impl GradOrder {
    /// Where `model`'s gradients are finished in the backward programs
    /// of `program`, and the parameters in the order they finish:
    /// [`GradOrder`] without its buckets.
    fn finishing(model: &Model, program: &Program) -> Result<(Self, Vec<usize>)> {
        let hb = &model.head.backward;
        // the head's gradients written nowhere are added after its last step
        let (mut head_after, unwritten) = finished_in(hb, &program.head_backward, 0);
        if let Some(last) = head_after.last_mut() {
            last.extend(unwritten);
        }
        let (eager_after, lazy): (Vec<_>, Vec<_>) = model
            .functions
            .iter()
            .zip(&program.functions)
            .map(|(func, (_, prog))| finished_in(&func.backward, prog, EAGER))
            .unzip();
        let graphs = || std::iter::once(hb).chain(model.functions.iter().map(|f| &f.backward));
        let mut outputs_of = vec![0; model.params.len()];
        for p in graphs().flat_map(|g| g.outputs.iter().filter_map(grad_param)) {
            *outputs_of.get_mut(p).ok_or_else(|| {
                model_err(format!("a gradient of parameter {p}, beyond the last"))
            })? += 1;
        }
        // the parameters as their last output comes in
        let mut left = outputs_of.clone();
        let mut finished = Vec::new();
        let mut arrive = |g: &Graph, o: usize| {
            if let Some(p) = grad_param(&g.outputs[o]) {
                left[p] -= 1;
                if left[p] == 0 {
                    finished.push(p);
                }
            }
        };
        // as the backward pass runs: the head, every function's eager
        // steps, every function's lazy phase
        head_after.iter().flatten().for_each(|&o| arrive(hb, o));
        for (func, after) in model.functions.iter().zip(&eager_after) {
            after
                .iter()
                .flatten()
                .for_each(|&o| arrive(&func.backward, o));
        }
        for (func, outputs) in model.functions.iter().zip(&lazy) {
            outputs.iter().for_each(|&o| arrive(&func.backward, o));
        }
        let order = GradOrder {
            head_after,
            eager_after,
            lazy,
            outputs_of,
            buckets: Vec::new(),
            spans: Vec::new(),
        };
        Ok((order, finished))
    }

    /// The order of `model`'s gradients in the backward programs of
    /// `program`, in buckets of at most `cap` bytes over the gradient
    /// buffer of `views`.
    fn new(model: &Model, program: &Program, views: &DeviceParams, cap: usize) -> Result<Self> {
        let (mut order, finished) = Self::finishing(model, program)?;
        let grads = &views.grads;
        let sizes: Vec<(usize, usize)> =
            finished.iter().map(|&p| (p, grads[p].len() * 4)).collect();
        order.buckets = bucket::plan(&sizes, cap)
            .map_err(|e| model_err(e.to_string()))?
            .into_iter()
            .map(|b| b.params)
            .collect();
        let base = views.grad_all.device_ptr();
        order.spans = order
            .buckets
            .iter()
            .map(|params| {
                let mut spans: Vec<(usize, usize)> = params
                    .iter()
                    .map(|&p| ((grads[p].device_ptr() - base) as usize / 4, grads[p].len()))
                    .collect();
                spans.sort_unstable();
                let mut merged: Vec<(usize, usize)> = Vec::with_capacity(spans.len());
                for (at, len) in spans {
                    match merged.last_mut() {
                        Some(last) if last.0 + last.1 == at => last.1 += len,
                        _ => merged.push((at, len)),
                    }
                }
                merged
            })
            .collect();
        Ok(order)
    }

    /// The head's gradient outputs by the steps of its backward program
    /// run before they are added.
    pub(crate) fn head_after(&self) -> &[Vec<usize>] {
        &self.head_after
    }

    /// The same for vertex function `f`'s eager steps.
    pub(crate) fn eager_after(&self, f: usize) -> &[Vec<usize>] {
        self.eager_after.get(f).map_or(&[], |a| &a[..])
    }

    /// Vertex function `f`'s gradient outputs added after its lazy phase.
    pub(crate) fn lazy(&self, f: usize) -> &[usize] {
        self.lazy.get(f).map_or(&[], |o| &o[..])
    }
}

impl CudaEngine {
    /// The sums of a batch whose rows are `scale` of the step's, with the
    /// step's earlier batches in `accumulated` (gradients, then the loss);
    /// the side lane and the gradient order made on first use.
    pub(crate) fn grad_sums(
        &mut self,
        model: &Model,
        scale: f32,
        accumulated: Option<DeviceView<f32>>,
    ) -> Result<GradSums> {
        if self.sums.lane.is_none() {
            let views = self.param_views()?;
            let cap = self.sums.bucket_bytes;
            let order = GradOrder::new(model, &self.program, views, cap)?;
            self.sums.lane = Some(SideLane {
                order: Arc::new(order),
                stream: self.device.new_stream()?,
                ready: self.device.new_event()?,
                eager_tail: self.device.new_event()?,
                summed: self.device.new_event()?,
            });
        }
        let order = self.side_lane()?.order.clone();
        Ok(GradSums {
            left: order.outputs_of.clone(),
            order,
            scale,
            accumulated,
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
        let spans = sums.order.spans[k]
            .iter()
            .map(|&(at, len)| grad_all.slice(at..at + len).map(|v| (at, v)))
            .collect::<Result<Vec<_>>>()?;
        self.add_accumulated(sums, &spans, &lane.stream)?;
        side.ready.record(&lane.stream).in_call("cuEventRecord")?;
        side.stream.wait(&side.ready).in_call("cuStreamWaitEvent")?;
        let buffers = spans
            .iter()
            .map(|&(_, v)| on_stream(v, &side.stream))
            .collect();
        c.sum_buffers(buffers, f64::from(sums.sum_scale()))
            .map_err(|e| CudaError::Nccl(e.to_string()))
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
        while sums.fired < sums.order.buckets.len() {
            self.sum_bucket(&sums, sums.fired, c, &self.main)?;
            sums.fired += 1;
        }
        let n = self.param_views()?.grad_all.len();
        self.add_accumulated(&sums, &[(n, slot)], &self.main.stream)?;
        let side = self.side_lane()?;
        side.ready
            .record(&self.main.stream)
            .in_call("cuEventRecord")?;
        side.stream.wait(&side.ready).in_call("cuStreamWaitEvent")?;
        c.sum_buffers(
            vec![on_stream(slot, &side.stream)],
            f64::from(sums.sum_scale()),
        )
        .map_err(|e| CudaError::Nccl(e.to_string()))?;
        side.summed.record(&side.stream).in_call("cuEventRecord")?;
        self.main
            .stream
            .wait(&side.summed)
            .in_call("cuStreamWaitEvent")
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

#[cfg(test)]
mod tests {
    use super::*;
    use ramus_conformance::zoo::Case;

    /// The finishing order of a model's gradients, checked: every trained
    /// parameter finishes once, buffers never.
    fn finishing(name: &'static str) -> (GradOrder, Vec<usize>) {
        let case = Case::new(name, 2, 1, 17).unwrap();
        let (program, _) = Program::plan(&case.model).unwrap();
        let (order, finished) = GradOrder::finishing(&case.model, &program).unwrap();
        let mut once = finished.clone();
        once.sort_unstable();
        once.dedup();
        assert_eq!(
            once.len(),
            finished.len(),
            "{name}: a parameter finished twice"
        );
        for p in 0..case.model.params.len() {
            let has = order.outputs_of[p] > 0;
            assert_eq!(finished.contains(&p), has, "{name}: parameter {p}");
            assert_eq!(
                has,
                !case.model.is_buffer(p),
                "{name}: parameter {p} trained"
            );
        }
        (order, finished)
    }

    /// A ResNet (one vertex per image) finishes its gradients all through
    /// its eager backward steps, the last layer's first, so its buckets
    /// can be summed while the pass goes on; none waits for the lazy phase.
    #[test]
    fn a_resnets_gradients_finish_through_its_backward_pass() {
        let (order, finished) = finishing("resnet");
        let eager = order.eager_after(0);
        let steps = eager.len() - 1;
        let after: Vec<usize> = (0..=steps).filter(|&i| !eager[i].is_empty()).collect();
        assert!(
            after.len() >= 10,
            "gradients finish at {} of {steps} steps",
            after.len()
        );
        assert!(
            after[0] < steps / 4,
            "the first gradient after step {} of {steps}",
            after[0]
        );
        assert!(
            order.lazy(0).is_empty(),
            "{:?} wait for the lazy phase",
            order.lazy(0)
        );
        // declared input to output: the classifier's finish first, the stem's last
        assert!(finished.first() > finished.last(), "{finished:?}");
    }

    /// A Tree-LSTM's head finishes its parameters before the tree's
    /// backward pass; the vertex function's come after its levels.
    #[test]
    fn a_tree_lstms_head_finishes_before_its_tree() {
        let (order, finished) = finishing("treelstm");
        let head: usize = order.head_after().iter().map(Vec::len).sum();
        assert!(
            head > 0 && head < finished.len(),
            "{head} of {}",
            finished.len()
        );
        assert!(!order.lazy(0).is_empty());
    }
}
