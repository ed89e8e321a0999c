//! The CUDA batched engine's training step split for data parallelism
//! ([`SplitStep`]). The local step is the forward pass (its loss comes back
//! to the host, as on one GPU) with the rows each embedding table's
//! gradient will set, read from the batch's schedule; the global step
//! enqueues the backward pass, the gradients' sum over the ranks (NCCL on
//! the engine's stream) and the fused update over every rank's rows,
//! without waiting: as on one GPU, a step's outcome comes back with the
//! next step's loss, or from [`finish`](ramus_exec::TrainEngine::finish).

use ramus_exec::data_parallel::{
    row_sets_of, take_united_rows, Collective, DeviceBuffer, GlobalStep, GradBuffer, LocalStep,
    SplitStep,
};
use ramus_exec::{Batch, ExecError, Result, StepOutcome};

use super::train::SplitPending;
use super::CudaTrainer;
use crate::pool::DeviceView;

impl SplitStep<f32> for CudaTrainer {
    fn local_step(&mut self, batch: Option<&Batch<'_>>) -> Result<LocalStep> {
        let (model, params, config) = (&self.model, &mut self.uploaded, &self.config);
        let e = &mut self.engine;
        e.check_model(model)?;
        e.sync_params(model, params)?;
        e.keep_buffers(model, config)?;
        let (loss, rows, lists) = match batch {
            Some(batch) => {
                let (loss, rows) = e.train_forward(model, params, batch)?;
                (loss, rows, e.touched_row_lists(model, &batch.schedule))
            }
            None => {
                // nothing ran: wait for the last step, whose status is read next
                e.device
                    .stream()
                    .synchronize()
                    .map_err(|err| ExecError::Device(format!("cuStreamSynchronize: {err}")))?;
                let lists = e
                    .program
                    .row_grad_params
                    .iter()
                    .map(|&p| (p, Vec::new()))
                    .collect();
                (0.0, 0, lists)
            }
        };
        // the last step's status came back with this loss
        let previous = e.settle_step()?;
        let row_sets = row_sets_of(&lists);
        self.split = Some(SplitPending {
            rows: lists,
            previous,
        });
        Ok(LocalStep {
            loss,
            rows,
            row_sets,
        })
    }

    fn global_step(
        &mut self,
        collective: &mut dyn Collective<f32>,
        batch: Option<&Batch<'_>>,
        step: GlobalStep,
    ) -> Result<Vec<StepOutcome>> {
        let mut pending = self.split.take().ok_or_else(|| {
            ExecError::Config("data-parallel step: global_step needs local_step first".into())
        })?;
        take_united_rows(&mut pending.rows, step.row_sets)?;
        let (model, params, config) = (&self.model, &mut self.uploaded, &self.config);
        let e = &mut self.engine;
        let stream = e.device.stream().clone();
        let grad_all = e.param_views()?.grad_all;
        match batch {
            Some(batch) => e.backward_on_device(model, params, batch)?,
            None => e.launcher.fill(&stream, grad_all, 0.0)?,
        }
        let buffer = DeviceBuffer {
            ptr: grad_all.device_ptr(),
            len: grad_all.len(),
            stream: stream.cu_stream() as u64,
        };
        collective.sum_buffers(vec![GradBuffer::Device(buffer)], step.scale)?;
        let touched: Vec<DeviceView<u32>> = e
            .upload_row_lists(&pending.rows)?
            .into_iter()
            .map(|(_, v)| v)
            .collect();
        // the update checks the loss of all ranks, the same on every rank
        let slot = e.device_optimizer(model, config)?.loss_slot()?;
        e.staging.upload_slice(&[step.loss as f32], slot, &stream)?;
        let report =
            e.device_optimizer(model, config)?
                .step(&stream, &touched, Some(slot), false)?;
        for _ in 0..report.launches {
            e.launcher.count();
        }
        e.step_submitted(params, step.loss);
        Ok(pending.previous.into_iter().collect())
    }
}
