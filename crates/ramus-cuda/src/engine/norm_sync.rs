//! Synchronized batch normalisation on the CUDA batched engine (and on the
//! swap path, which runs the engine's ops): in a training pass, a batch-norm
//! layer's statistics are those of every rank's rows. Each layer's sums
//! are summed over the ranks (NCCL, through another handle on the rank's
//! group) on the engine's main stream between its kernels; the backward
//! pass reuses the forward's statistics and sums its gradient sums the same
//! way. A rank without rows in a step sums zeros in their stead, in the
//! order of its last step with rows, and still blends its running
//! statistics.

use std::collections::HashMap;

use ramus_core::graph::{Graph, NodeId, NodeKind, ParamId, Source};
use ramus_core::ops::{BatchNorm, NormGeom, Op};
use ramus_core::Model;
use ramus_exec::data_parallel::{Collective, DeviceBuffer, GradBuffer};

mod state;

use super::cnn::CnnArgs;
use super::{model_err, CudaEngine, Lane};
use crate::error::{CudaError, InCall, Result};
use crate::launch::{synced_len, BatchNormOperands, NormGradOperands};
use crate::pool::DeviceView;
pub(crate) use state::NormSync;
use state::{parts, Call};

/// The parameter of node `n`'s input `i`, if it is one.
fn param_input(g: &Graph, n: NodeId, i: usize) -> Option<ParamId> {
    let input = *g.nodes[n].inputs.get(i)?;
    match g.nodes[input].kind {
        NodeKind::Param(p) => Some(p),
        _ => None,
    }
}

impl CudaEngine {
    /// Makes training passes normalise batches with the statistics of
    /// every rank's rows, summed through `collective` (another handle on
    /// the rank's data-parallel group, on the engine's stream). Refused for
    /// a model whose batch norms are in more than one graph.
    pub fn sync_batch_norm(
        &mut self,
        model: &Model,
        collective: Box<dyn Collective<f32>>,
    ) -> Result<()> {
        let graphs = model
            .functions
            .iter()
            .map(|f| &f.forward)
            .chain([&model.head.forward]);
        let mut layers = HashMap::new();
        let mut holding = 0;
        for g in graphs {
            let before = layers.len();
            for node in &g.nodes {
                if let Some(Op::BatchNorm(BatchNorm(norm))) = node.op() {
                    let len = 2 * synced_len(norm) + 2 * norm.channels;
                    let x = node.inputs.first().copied().unwrap_or_default();
                    if layers
                        .insert(x, (*norm, self.pool.alloc::<f32>(len)?))
                        .is_some()
                    {
                        return Err(model_err(format!(
                            "synchronized batch norm: two batch norms of model `{}` read node \
                             %{x} (a layer is known by its input)",
                            model.name
                        )));
                    }
                }
            }
            holding += usize::from(layers.len() > before);
        }
        if holding > 1 {
            return Err(model_err(format!(
                "synchronized batch norm: model `{}` has batch norms in {holding} graphs (one \
                 is supported)",
                model.name
            )));
        }
        self.norm_sync = Some(std::cell::RefCell::new(NormSync {
            collective,
            layers,
            calls: Vec::new(),
            before_sum: self.device.new_event()?,
            after_sum: self.device.new_event()?,
        }));
        Ok(())
    }

    /// Whether this pass's training batch norms are synchronized.
    pub(super) fn norm_synced(&self) -> bool {
        self.norm_sync.is_some() && !self.inference_pass
    }

    /// Synchronized batch norm, before a step's passes on this rank's rows
    /// (`rows`), or in their stead: the last step's sums, of zeros.
    pub(crate) fn start_norm_step(&mut self, rows: bool) -> Result<()> {
        let Some(sync) = &self.norm_sync else {
            return Ok(());
        };
        let calls = {
            let mut sync = sync.borrow_mut();
            if rows {
                sync.calls.clear();
                return Ok(());
            }
            if sync.calls.is_empty() && sync.collective.world() > 1 {
                return Err(model_err(format!(
                    "synchronized batch norm: rank {} has no graph in a step before any step \
                     with graphs (the dataset has fewer graphs than ranks?)",
                    sync.collective.rank()
                )));
            }
            sync.calls.clone()
        };
        for call in calls {
            self.stand_in(call)?;
        }
        Ok(())
    }

    /// One of a step's sums with zeros (a rank without rows).
    fn stand_in(&self, call: Call) -> Result<()> {
        let main = &self.main;
        let layer = match call {
            Call::Forward { layer, .. } | Call::Backward { layer } => layer,
        };
        let (norm, [sums, stats, grads]) = self.buffers(layer)?;
        let c = norm.channels;
        let Call::Forward {
            params, running, ..
        } = call
        else {
            self.launcher.fill(&main.stream, grads, 0.0)?;
            return self.sum_on_main(main, grads);
        };
        self.launcher.fill(&main.stream, sums, 0.0)?;
        self.sum_on_main(main, sums.slice(0..c + 1)?)?;
        self.sum_on_main(main, sums.slice(c + 1..2 * c + 1)?)?;
        let values = &self.param_views()?.values;
        let value = |p: ParamId| values.get(p).copied().ok_or_else(|| no_param(p));
        let operands = BatchNormOperands {
            x: sums, // not read
            gamma: value(params[0])?,
            beta: value(params[1])?,
            running: match running {
                Some((m, v)) => Some((value(m)?, value(v)?)),
                None => None,
            },
        };
        let views = (None, stats, sums);
        (self.launcher).batch_norm_coef_synced(&main.stream, views, operands, &norm)
    }

    /// `view`'s floats summed over the ranks on the main stream, after
    /// `lane`'s work so far and before its next.
    fn sum_on_main(&self, lane: &Lane, view: DeviceView<f32>) -> Result<()> {
        let sync = self
            .norm_sync
            .as_ref()
            .ok_or_else(|| model_err("no norm sync"))?;
        let mut sync = sync.borrow_mut();
        let main = self.device.stream();
        let elsewhere = lane.stream.cu_stream() != main.cu_stream();
        if elsewhere {
            sync.before_sum
                .record(&lane.stream)
                .in_call("cuEventRecord")?;
            main.wait(&sync.before_sum).in_call("cuStreamWaitEvent")?;
        }
        let buffer = GradBuffer::Device(DeviceBuffer {
            ptr: view.device_ptr(),
            len: view.len(),
            stream: main.cu_stream() as u64,
        });
        sync.collective
            .sum_buffers(vec![buffer], 1.0)
            .map_err(|e| CudaError::Nccl(format!("synchronized batch norm: {e}")))?;
        if elsewhere {
            sync.after_sum.record(main).in_call("cuEventRecord")?;
            lane.stream
                .wait(&sync.after_sum)
                .in_call("cuStreamWaitEvent")?;
        }
        Ok(())
    }

    /// The layer of the batch-norm op in `a`: the node of its input in the
    /// forward graph (a backward graph reads it as `Forward(x)`).
    fn layer_of(a: &CnnArgs<'_>) -> NodeId {
        let x = a.arg(0);
        match a.g.nodes[x].kind {
            NodeKind::Input(Source::Forward(m)) => m,
            _ => x,
        }
    }

    /// Layer `layer`'s geometry and buffers.
    fn buffers(&self, layer: NodeId) -> Result<(NormGeom, [DeviceView<f32>; 3])> {
        let sync = self
            .norm_sync
            .as_ref()
            .ok_or_else(|| model_err("no norm sync"))?;
        let sync = sync.borrow();
        let (norm, buf) = sync.layers.get(&layer).ok_or_else(|| no_layer(layer))?;
        Ok((*norm, parts(norm, buf)?))
    }

    /// The buffers of `a`'s layer, recording `call` on it.
    fn layer(
        &self,
        a: &CnnArgs<'_>,
        call: impl Fn(NodeId) -> Call,
    ) -> Result<[DeviceView<f32>; 3]> {
        let layer = Self::layer_of(a);
        let sync = self
            .norm_sync
            .as_ref()
            .ok_or_else(|| model_err("no norm sync"))?;
        sync.borrow_mut().calls.push(call(layer));
        Ok(self.buffers(layer)?.1)
    }

    /// Training batch normalisation over every rank's rows: this rank's
    /// sums, summed, then the squared deviations, summed, then the
    /// coefficients, statistics and running statistics.
    pub(super) fn batch_norm_synced(
        &self,
        a: &CnnArgs<'_>,
        norm: &NormGeom,
        operands: BatchNormOperands,
        (coef, r): (DeviceView<f32>, usize),
    ) -> Result<()> {
        let param = |i| param_input(a.g, a.n, i).ok_or_else(|| not_param(a, i));
        let params = [param(1)?, param(2)?];
        let running = match operands.running {
            Some(_) => Some((param(3)?, param(4)?)),
            None => None,
        };
        let [sums, stats, _] = self.layer(a, |layer| Call::Forward {
            layer,
            params,
            running,
        })?;
        let (stream, c) = (&*a.lane.stream, norm.channels);
        self.launcher.norm_sums(stream, sums, operands.x, r, norm)?;
        self.sum_on_main(a.lane, sums.slice(0..c + 1)?)?;
        self.launcher
            .norm_sq_dev(stream, sums, operands.x, r, norm)?;
        self.sum_on_main(a.lane, sums.slice(c + 1..2 * c + 1)?)?;
        let views = (Some(coef), stats, sums);
        self.launcher
            .batch_norm_coef_synced(stream, views, operands, norm)
    }

    /// Training batch normalisation's input gradient over every rank's
    /// rows: this rank's gradient sums, summed, then the coefficients.
    pub(super) fn batch_norm_backward_input_synced(
        &self,
        a: &CnnArgs<'_>,
        norm: &NormGeom,
        operands: NormGradOperands,
        (dx, coef, r): (DeviceView<f32>, DeviceView<f32>, usize),
    ) -> Result<()> {
        let [_, stats, grads] = self.layer(a, |layer| Call::Backward { layer })?;
        let stream = &*a.lane.stream;
        let inputs = (operands.x, operands.dy, stats);
        (self.launcher).norm_grad_sums(stream, (grads, true), inputs, r, norm)?;
        self.sum_on_main(a.lane, grads)?;
        let sums = (grads, stats);
        (self.launcher).batch_norm_backward_input_synced(
            stream,
            (dx, coef),
            operands,
            sums,
            (r, norm),
        )
    }

    /// Gamma's gradient, `Σ dy·x̂` over this rank's rows with `x̂` from
    /// every rank's statistics (the parameter gradients are summed later).
    pub(super) fn batch_norm_backward_gamma_synced(
        &self,
        a: &CnnArgs<'_>,
        norm: &NormGeom,
        (out, x, dy): (DeviceView<f32>, DeviceView<f32>, DeviceView<f32>),
        r: usize,
    ) -> Result<()> {
        let [_, stats, _] = self.buffers(Self::layer_of(a))?.1;
        (self.launcher).norm_grad_sums(&a.lane.stream, (out, false), (x, dy, stats), r, norm)
    }
}

fn no_layer(layer: NodeId) -> CudaError {
    model_err(format!(
        "synchronized batch norm: no statistics for the batch norm of forward node %{layer}"
    ))
}

fn no_param(p: ParamId) -> CudaError {
    model_err(format!(
        "synchronized batch norm: no parameter {p} on the device"
    ))
}

fn not_param(a: &CnnArgs<'_>, i: usize) -> CudaError {
    model_err(format!(
        "synchronized batch norm: input {i} of node %{} is not a parameter",
        a.n
    ))
}
