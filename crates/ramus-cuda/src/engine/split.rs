//! The CUDA batched engine's training step split for data parallelism
//! ([`SplitStep`]): the forward pass (its loss comes back to the host, as
//! on one GPU), the backward pass, whose gradients are summed over the
//! ranks in buckets as it finishes them (NCCL on a side stream, see
//! [`overlap`](super::overlap)), then the fused update over the step
//! plan's rows, without waiting: the update checks the summed loss on the
//! device and copies it back with its status, so a step's outcome comes
//! back with the next step's loss, or from
//! [`finish`](ramus_exec::TrainEngine::finish), as on one GPU.
//!
//! The update half ([`CudaEngine::split_update`]) is shared with the swap
//! path, whose op-by-op step ends in it.

use ramus_core::{Model, Params};
use ramus_exec::data_parallel::{Collective, SplitStep, StepPlan};
use ramus_exec::{Batch, ExecError, OptimizerConfig, Result, StepOutcome};

use super::overlap::{GradSums, Overlap};
use super::train::{mid_step, Accumulator};
use super::{CudaEngine, CudaTrainer, StepLoss};
use crate::pool::DeviceView;

/// What the update half of a split step works with; the batch's
/// gradients are in the engine's gradient buffer and its mean loss in
/// the optimizer's loss slot.
pub(crate) struct SplitUpdate<'a> {
    pub model: &'a Model,
    /// The host parameters, whose device copy the update moves ahead.
    pub params: &'a mut Params<f32>,
    pub config: &'a OptimizerConfig,
    pub collective: &'a mut dyn Collective<f32>,
    pub plan: &'a StepPlan,
    /// This rank's head rows in the batch.
    pub rows: usize,
    pub accumulator: &'a mut Option<Accumulator>,
    /// The plan's row lists by table, uploaded (`None`: uploaded here).
    pub touched: Option<Vec<(usize, DeviceView<u32>)>>,
    /// The last batch's sums, started during its backward pass (`None`:
    /// all made here).
    pub sums: Option<GradSums>,
}

/// The step's earlier batches, when the accumulator holds any.
fn held(acc: &Option<Accumulator>) -> Option<DeviceView<f32>> {
    acc.as_ref().filter(|a| a.holding).map(|a| a.buf.view())
}

impl CudaEngine {
    /// An accumulator sized for the gradient buffer, made (empty) if
    /// missing or of another size.
    pub(crate) fn ensure_accumulator(&mut self, acc: &mut Option<Accumulator>) -> Result<()> {
        let len = self.param_views()?.grad_all.len() + 1;
        if acc.as_ref().is_none_or(|a| a.buf.len() != len) {
            *acc = None;
            let buf = self.pool.alloc::<f32>(len)?;
            *acc = Some(Accumulator {
                buf,
                holding: false,
            });
        }
        Ok(())
    }

    /// The update half of a data-parallel step: a batch before the step's
    /// last adds its gradients and loss, scaled by its share of the step's
    /// head rows, to the accumulator; the last adds the accumulator to its
    /// own, sums both over the ranks (the buckets its backward pass did not
    /// sum yet) and queues the fused update over the plan's rows, whose
    /// loss comes back with its status.
    pub(crate) fn split_update(&mut self, u: SplitUpdate<'_>) -> Result<()> {
        let stream = self.device.stream().clone();
        let scale = u.plan.scale(u.rows)? as f32;
        let grad_all = self.param_views()?.grad_all;
        let slot = self.device_optimizer(u.model, u.config)?.loss_slot()?;
        let n = grad_all.len();
        if !u.plan.last {
            self.ensure_accumulator(u.accumulator)?;
            let acc = u
                .accumulator
                .as_mut()
                .ok_or_else(|| ExecError::Device("gradient accumulation: no accumulator".into()))?;
            let kept = if acc.holding { 1.0 } else { 0.0 };
            let view = acc.buf.view();
            let launcher = &self.launcher;
            launcher.scale_add(&stream, (view.slice(0..n)?, kept), (grad_all, scale))?;
            launcher.scale_add(&stream, (view.slice(n..n + 1)?, kept), (slot, scale))?;
            acc.holding = true;
            return Ok(());
        }
        let touched = match u.touched {
            Some(touched) => touched,
            None => self.upload_row_lists(&u.plan.row_sets)?,
        };
        let sums = match u.sums {
            Some(sums) => sums,
            None => self.grad_sums(u.model, (scale, held(u.accumulator)), &touched)?,
        };
        self.finish_sums(sums, slot, u.collective)?;
        if let Some(acc) = u.accumulator.as_mut() {
            acc.holding = false;
        }
        let touched: Vec<DeviceView<u32>> = touched.into_iter().map(|(_, v)| v).collect();
        let report =
            self.device_optimizer(u.model, u.config)?
                .step(&stream, &touched, Some(slot), false)?;
        for _ in 0..report.launches {
            self.launcher.count();
        }
        self.step_submitted(u.params, StepLoss::Device);
        Ok(())
    }
}

impl SplitStep<f32> for CudaTrainer {
    fn split_step(
        &mut self,
        collective: &mut dyn Collective<f32>,
        batch: Option<&Batch<'_>>,
        plan: &StepPlan,
    ) -> Result<Vec<StepOutcome>> {
        let (model, params, config) = (&self.model, &mut self.uploaded, &self.config);
        let e = &mut self.engine;
        e.check_model(model)?;
        e.sync_params(model, params)?;
        // the running statistics before the step's first batch: a skipped
        // step puts them back (each batch blends its own into them)
        if !mid_step(&self.accumulated) {
            e.keep_buffers(model, config)?;
        }
        e.start_norm_step(batch.is_some())?;
        let stream = e.device.stream().clone();
        let (_, rows) = match batch {
            Some(batch) => e.train_forward(model, params, batch)?,
            None => {
                // nothing runs: wait for the last step, whose status is read next
                stream
                    .synchronize()
                    .map_err(|err| ExecError::Device(format!("cuStreamSynchronize: {err}")))?;
                (0.0, 0)
            }
        };
        // the last step's status came back with this loss
        let previous = e.settle_step()?;
        // the batch's loss into the optimizer's slot, on the device (staged
        // from the host, the copy would make the next step's first upload
        // wait for this step's backward pass and update)
        let slot = e.device_optimizer(model, config)?.loss_slot()?;
        match batch.map(|_| e.loss_view(model)).transpose()?.flatten() {
            Some(loss) => e.launcher.scale_add(&stream, (slot, 0.0), (loss, 1.0))?,
            None => e.launcher.fill(&stream, slot, 0.0)?,
        }
        // the update's rows, staged now: behind the backward pass the copy
        // would hold up the next step's uploads in the same way
        let touched = match plan.last {
            true => Some(e.upload_row_lists(&plan.row_sets)?),
            false => None,
        };
        let mut sums = match &touched {
            Some(touched) => {
                let scale = plan.scale(rows)? as f32;
                Some(e.grad_sums(model, (scale, held(&self.accumulated)), touched)?)
            }
            None => None,
        };
        match batch {
            Some(batch) => {
                let mut overlap = sums.as_mut().map(|sums| Overlap {
                    sums,
                    collective: &mut *collective,
                });
                e.backward_on_device(model, params, batch, overlap.as_mut())?
            }
            None => {
                let grad_all = e.param_views()?.grad_all;
                e.launcher.fill(&stream, grad_all, 0.0)?
            }
        }
        e.split_update(SplitUpdate {
            model,
            params,
            config,
            collective,
            plan,
            rows,
            accumulator: &mut self.accumulated,
            touched,
            sums,
        })?;
        Ok(previous.into_iter().collect())
    }
}
