//! Where the batched engine's backward pass finishes each parameter's
//! gradient, worked out once from its programs, and the buckets in that
//! order; and what the engine keeps for its sums (the side lane, the
//! times). See the parent module.

use std::cell::Cell;
use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaStream};
use ramus_core::graph::{Graph, NodeId, Role};
use ramus_core::Model;
use ramus_exec::bucket::{self, DEFAULT_BUCKET_BYTES};

use crate::error::{model_err, Result};
use crate::pool::DeviceView;
use crate::program::{GraphProgram, PlannedStep, Program, EAGER};

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
    pub(super) outputs_of: Vec<usize>,
    /// Parameters per bucket, in the order the buckets fill.
    pub(super) buckets: Vec<Vec<usize>>,
    /// Each bucket's spans of the gradient buffer (offset, floats): its
    /// dense parameters' gradients, merged where adjacent.
    pub(super) spans: Vec<Vec<(usize, usize)>>,
    /// Each bucket's embedding tables (gradients that arrive as rows):
    /// only the rows a step touches are summed.
    pub(super) tables: Vec<Vec<Table>>,
}

/// An embedding table's gradient in the gradient buffer.
#[derive(Clone, Copy, Debug)]
pub(super) struct Table {
    pub(super) param: usize,
    /// Offset and floats in the gradient buffer.
    pub(super) at: usize,
    pub(super) len: usize,
    /// Floats a row.
    pub(super) width: usize,
}

/// How an engine sums its gradients over the ranks: the bucket size, and
/// the side lane once made.
pub(crate) struct SumsSetup {
    pub(super) bucket_bytes: usize,
    pub(super) lane: Option<SideLane>,
    /// The steps' sum times read so far.
    pub(super) times: SumTimes,
    /// A step's timing events were recorded and not read yet.
    pub(super) unread: Cell<bool>,
}

impl SumsSetup {
    pub(crate) fn new(bucket_bytes: Option<usize>) -> Self {
        SumsSetup {
            bucket_bytes: bucket_bytes.unwrap_or(DEFAULT_BUCKET_BYTES),
            lane: None,
            times: SumTimes::default(),
            unread: Cell::new(false),
        }
    }
}

/// Where the gradient sums' time went, summed over steps: from the first
/// bucket's sum to the loss's (the sums and the backward pass they
/// overlap), and from the end of the backward pass to the loss's sum (what
/// the update waited for: the sums not hidden).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct SumTimes {
    pub steps: usize,
    pub span_ms: f64,
    pub exposed_ms: f64,
}

/// The side stream the sums run on, and the events that hand over to it
/// and back.
pub(super) struct SideLane {
    pub(super) order: Arc<GradOrder>,
    pub(super) stream: Arc<CudaStream>,
    pub(super) ready: CudaEvent,
    /// Where the main lane joins the eager lane before a bucket it sums.
    pub(super) eager_tail: CudaEvent,
    /// Timed: the side lane at the first sum of a step, the main lane at
    /// the end of its backward pass, the side lane after its last sum.
    pub(super) first_sum: CudaEvent,
    pub(super) backward_done: CudaEvent,
    pub(super) summed: CudaEvent,
}

/// The parameter whose gradient output `o` is.
pub(crate) fn grad_param(o: &ramus_core::graph::Output) -> Option<usize> {
    match o.role {
        Role::ParamGrad(p) | Role::ParamRowGrad(p) => Some(p),
        _ => None,
    }
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
            tables: Vec::new(),
        };
        Ok((order, finished))
    }

    /// The order of `model`'s gradients in the backward programs of
    /// `program`, in buckets of at most `cap` bytes over the gradient
    /// buffer `grad_all` (`grads`: each parameter's part).
    pub(super) fn new(
        model: &Model,
        program: &Program,
        (grads, grad_all): (&[DeviceView<f32>], DeviceView<f32>),
        cap: usize,
    ) -> Result<Self> {
        let (mut order, finished) = Self::finishing(model, program)?;
        let sizes: Vec<(usize, usize)> =
            finished.iter().map(|&p| (p, grads[p].len() * 4)).collect();
        order.buckets = bucket::plan(&sizes, cap)
            .map_err(|e| model_err(e.to_string()))?
            .into_iter()
            .map(|b| b.params)
            .collect();
        let base = grad_all.device_ptr();
        let at = |p: usize| (grads[p].device_ptr() - base) as usize / 4;
        let is_table = |p: &usize| program.row_grad_params.contains(p);
        order.tables = (order.buckets.iter())
            .map(|params| {
                let tables = params.iter().copied().filter(is_table);
                tables
                    .map(|param| Table {
                        param,
                        at: at(param),
                        len: grads[param].len(),
                        width: model.params[param].shape.iter().skip(1).product(),
                    })
                    .collect()
            })
            .collect();
        order.spans = order
            .buckets
            .iter()
            .map(|params| {
                let dense = params.iter().filter(|p| !is_table(p));
                let mut spans: Vec<(usize, usize)> =
                    dense.map(|&p| (at(p), grads[p].len())).collect();
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
