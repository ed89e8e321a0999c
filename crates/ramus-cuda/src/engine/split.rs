//! The CUDA batched engine's training step split for data parallelism
//! ([`SplitStep`]): forward and backward into the engine's gradient buffer,
//! the buffer summed over the ranks by the collective (NCCL, on the
//! engine's stream), then the fused optimizer update over the rows every
//! rank touched. Each step waits for its outcome, so no step is in flight
//! between the calls of the training loop.

use ramus_exec::data_parallel::{
    Collective, DeviceBuffer, GradBuffer, LocalStep, RowSet, SplitStep,
};
use ramus_exec::{Batch, ExecError, Mode, Result};

use super::train::SplitPending;
use super::{model_err, CudaTrainer};
use crate::pool::DeviceView;

impl SplitStep<f32> for CudaTrainer {
    fn local_gradients(&mut self, batch: Option<&Batch<'_>>) -> Result<LocalStep> {
        self.check_idle("a data-parallel step")?;
        let (model, params, config) = (&self.model, &mut self.uploaded, &self.config);
        let e = &mut self.engine;
        e.check_model(model)?;
        e.sync_params(model, params)?;
        e.keep_buffers(model, config)?;
        let Some(batch) = batch else {
            // no graphs on this rank: zero gradients, no rows
            let stream = e.device.stream().clone();
            let grad_all = e.param_views()?.grad_all;
            e.launcher.fill(&stream, grad_all, 0.0)?;
            let rows = e
                .program
                .row_grad_params
                .iter()
                .map(|&p| (p, Vec::new()))
                .collect();
            self.split = Some(SplitPending {
                rows,
                reduced: false,
            });
            return Ok(LocalStep { loss: 0.0, rows: 0 });
        };
        e.track_running_stats = true;
        let out = e.forward_pass(model, params, batch, Mode::Train, model.head.rows);
        e.track_running_stats = false;
        let out = out?;
        let loss = out
            .loss
            .ok_or_else(|| model_err("forward pass returned no loss"))?;
        e.backward_on_device(model, params, batch)?;
        let rows = e.touched_row_lists(model, &batch.schedule);
        self.split = Some(SplitPending {
            rows,
            reduced: false,
        });
        Ok(LocalStep {
            loss,
            rows: out.head_vertices.len(),
        })
    }

    fn reduce_gradients(&mut self, collective: &mut dyn Collective<f32>, scale: f64) -> Result<()> {
        let pending = self
            .split
            .as_mut()
            .ok_or_else(|| order("reduce_gradients", "local_gradients"))?;
        let sets = pending
            .rows
            .iter()
            .map(|(_, rows)| RowSet::Rows(rows.clone()))
            .collect();
        let united = collective.unite_rows(sets)?;
        for ((_, rows), set) in pending.rows.iter_mut().zip(united) {
            match set {
                RowSet::Rows(all) => *rows = all,
                RowSet::Dense => {
                    return Err(ExecError::Device(
                        "a row-gradient table came back dense from the other ranks".into(),
                    ))
                }
            }
        }
        let e = &mut self.engine;
        let grad_all = e.param_views()?.grad_all;
        let buffer = DeviceBuffer {
            ptr: grad_all.device_ptr(),
            len: grad_all.len(),
            stream: e.device.stream().cu_stream() as u64,
        };
        collective.sum_buffers(vec![GradBuffer::Device(buffer)], scale)?;
        pending.reduced = true;
        Ok(())
    }

    fn apply_update(&mut self, loss: f64) -> Result<f64> {
        let pending = match self.split.take() {
            Some(p) if p.reduced => p,
            _ => return Err(order("apply_update", "reduce_gradients")),
        };
        let (model, params, config) = (&self.model, &mut self.uploaded, &self.config);
        let e = &mut self.engine;
        let stream = e.device.stream().clone();
        let touched: Vec<DeviceView<u32>> = e
            .upload_row_lists(&pending.rows)?
            .into_iter()
            .map(|(_, v)| v)
            .collect();
        // the update checks the loss of all ranks, the same on every rank
        let opt = e.device_optimizer(model, config)?;
        let slot = opt.loss_slot()?;
        e.staging.upload_slice(&[loss as f32], slot, &stream)?;
        let report =
            e.device_optimizer(model, config)?
                .step(&stream, &touched, Some(slot), false)?;
        for _ in 0..report.launches {
            e.launcher.count();
        }
        e.step_submitted(params, loss);
        stream
            .synchronize()
            .map_err(|err| ExecError::Device(format!("cuStreamSynchronize: {err}")))?;
        match e.settle_step()? {
            Some(Ok(_)) | None => Ok(loss),
            Some(Err(step)) => Err(step.into()),
        }
    }
}

/// A split step's calls out of order.
fn order(call: &str, before: &str) -> ExecError {
    ExecError::Config(format!("data-parallel step: {call} needs {before} first"))
}
