//! The CUDA batched engine's training step split for data parallelism
//! ([`SplitStep`]): the forward pass (its loss comes back to the host, as
//! on one GPU), the backward pass, then the gradients and the loss summed
//! over the ranks (NCCL on the engine's stream) and the fused update over
//! the step plan's rows, without waiting: the update checks the summed
//! loss on the device and copies it back with its status, so a step's
//! outcome comes back with the next step's loss, or from
//! [`finish`](ramus_exec::TrainEngine::finish), as on one GPU.

use ramus_exec::data_parallel::{Collective, DeviceBuffer, GradBuffer, SplitStep, StepPlan};
use ramus_exec::{Batch, ExecError, Result, StepOutcome};

use super::{CudaTrainer, StepLoss};
use crate::pool::DeviceView;

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
        e.keep_buffers(model, config)?;
        let stream = e.device.stream().clone();
        let (loss, rows) = match batch {
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
        let scale = plan.scale(rows)?;
        let grad_all = e.param_views()?.grad_all;
        match batch {
            Some(batch) => e.backward_on_device(model, params, batch)?,
            None => e.launcher.fill(&stream, grad_all, 0.0)?,
        }
        // a step's batches before its last: their scaled gradients summed
        if !plan.last {
            let (sum, summed, kept) = match self.accumulated.take() {
                Some((sum, summed)) => (sum, summed, 1.0),
                None => (e.pool.alloc::<f32>(grad_all.len())?, 0.0, 0.0),
            };
            let grads = (grad_all, scale as f32);
            e.launcher.scale_add(&stream, (sum.view(), kept), grads)?;
            self.accumulated = Some((sum, summed + scale * loss));
            return Ok(previous.into_iter().collect());
        }
        // the loss, summed with the gradients: this batch's and the step's
        // scale, or (accumulated) the step's share already scaled
        let (scale, loss) = match self.accumulated.take() {
            Some((sum, summed)) => {
                let grads = (grad_all, scale as f32);
                e.launcher.scale_add(&stream, grads, (sum.view(), 1.0))?;
                (1.0, summed + scale * loss)
            }
            None => (scale, loss),
        };
        let slot = e.device_optimizer(model, config)?.loss_slot()?;
        e.staging.upload_slice(&[loss as f32], slot, &stream)?;
        let on_stream = |v: DeviceView<f32>| {
            GradBuffer::Device(DeviceBuffer {
                ptr: v.device_ptr(),
                len: v.len(),
                stream: stream.cu_stream() as u64,
            })
        };
        collective.sum_buffers(vec![on_stream(grad_all), on_stream(slot)], scale)?;
        let touched: Vec<DeviceView<u32>> = e
            .upload_row_lists(&plan.row_sets)?
            .into_iter()
            .map(|(_, v)| v)
            .collect();
        let report =
            e.device_optimizer(model, config)?
                .step(&stream, &touched, Some(slot), false)?;
        for _ in 0..report.launches {
            e.launcher.count();
        }
        e.step_submitted(params, StepLoss::Device);
        Ok(previous.into_iter().collect())
    }
}
