//! The persistent engine's training step split for data parallelism
//! ([`SplitStep`]). The update cannot stay in the kernel: the gradients
//! must be summed over the ranks first, and a kernel that waited for the
//! sum would hold every multiprocessor the sum's own kernel needs (the
//! persistent kernel runs one resident block per processor), so it would
//! never come. The kernel therefore ends with every gradient in its pool
//! slot ([`PersistentEngine::defer_updates`]); the local step launches it
//! and reads the loss back, the global step sums the slots over the ranks
//! (NCCL on the engine's stream) and updates them with the batched
//! engine's device optimizer, whose moments then hold the optimizer state.
//! A step whose summed loss or gradient is not finite is skipped, as on
//! the batched engine.

use std::time::Instant;

use ramus_exec::data_parallel::{
    row_sets_of, take_united_rows, Collective, GlobalStep, GradBuffer, LocalStep, SplitStep,
};
use ramus_exec::{Batch, ExecError, NonFiniteStep, Optimizer, Result, StepOutcome};

use super::train::Split;
use super::PersistentTrainer;
use crate::batch::{head_vertices, touched_rows};
use crate::optimizer::{DeviceOptimizer, StepStatus};

fn device_err(e: crate::error::CudaError) -> ExecError {
    ExecError::Device(e.to_string())
}

impl PersistentTrainer {
    /// Trains as one rank of a data-parallel run from now on (see the
    /// module docs); the optimizer state moves from the kernel's pool
    /// slots to the device optimizer.
    pub fn split_updates(&mut self) -> Result<()> {
        self.check_idle("split_updates()")?;
        let params = self.engine.params(&self.model).map_err(device_err)?;
        let mut moments = Optimizer::new(self.config, &params);
        self.engine
            .download_optimizer(&mut moments)
            .map_err(device_err)?;
        self.engine.defer_updates().map_err(device_err)?;
        self.split = Some(Split {
            row_params: crate::program::row_grad_params(&self.model)
                .into_iter()
                .collect(),
            optimizer: None,
            moments: Some(moments),
            rows: Vec::new(),
            loss: None,
            previous: None,
            lists: Vec::new(),
            rates: Default::default(),
        });
        Ok(())
    }

    fn split(&mut self) -> Result<&mut Split> {
        self.split.as_mut().ok_or_else(|| {
            ExecError::Config("a data-parallel step on a trainer not split (split_updates)".into())
        })
    }

    /// The device optimizer over the pool as it is now: rebuilt (its state
    /// carried over) when the pool has moved.
    fn optimizer(&mut self) -> Result<&mut DeviceOptimizer> {
        let address = self.engine.buffer_address();
        let split = self
            .split
            .as_mut()
            .ok_or_else(|| ExecError::Config("not split".into()))?;
        let stale = !matches!(&split.optimizer, Some((a, _)) if *a == address);
        if stale {
            if let Some((_, mut old)) = split.optimizer.take() {
                let params = self.engine.params(&self.model).map_err(device_err)?;
                let mut host = Optimizer::new(self.config, &params);
                old.download_into(self.engine.stream(), &mut host)
                    .map_err(device_err)?;
                split.moments = Some(host);
            }
            let rows = split.row_params.clone();
            let mut opt = self
                .engine
                .device_optimizer(&self.model, &self.config, &rows)
                .map_err(device_err)?;
            if let Some(host) = split.moments.take() {
                opt.upload_from(self.engine.stream(), &host)
                    .map_err(device_err)?;
            }
            split.optimizer = Some((address, opt));
        }
        match &mut split.optimizer {
            Some((_, opt)) => Ok(opt),
            None => Err(ExecError::Device("device optimizer missing".into())),
        }
    }

    /// The last update's outcome (the stream has passed it).
    pub(super) fn settle_split(&mut self) -> Result<Option<StepOutcome>> {
        let Some(split) = self.split.as_mut() else {
            return Ok(None);
        };
        let Some(loss) = split.loss.take() else {
            return Ok(None);
        };
        split.lists.clear();
        let status = match split.optimizer.as_mut() {
            Some((_, opt)) => opt.take_status().map_err(device_err)?,
            None => None,
        };
        Ok(Some(match status {
            Some(StepStatus { applied: true, .. }) => Ok(loss),
            None if loss.is_finite() => Ok(loss),
            _ => Err(NonFiniteStep { loss, param: None }),
        }))
    }

    /// The optimizer state of a split trainer (its device optimizer's, or
    /// the one waiting for it).
    pub(super) fn split_moments(&mut self, host: &mut Optimizer<f32>) -> Result<bool> {
        let stream = self.engine.stream().clone();
        let Some(split) = self.split.as_mut() else {
            return Ok(false);
        };
        match (&mut split.optimizer, &split.moments) {
            (Some((_, opt)), _) => opt.download_into(&stream, host).map_err(device_err)?,
            (None, Some(m)) => *host = m.clone(),
            (None, None) => {}
        }
        Ok(true)
    }

    /// Restores a split trainer's optimizer state: `false` if not split.
    pub(super) fn restore_split_moments(&mut self, host: &Optimizer<f32>) -> bool {
        match self.split.as_mut() {
            Some(split) => {
                split.optimizer = None;
                split.moments = Some(host.clone());
                true
            }
            None => false,
        }
    }
}

impl SplitStep<f32> for PersistentTrainer {
    /// Lowers the window's batches in parallel, as the engine does alone.
    fn prepare(&mut self, batches: &[Batch<'_>]) -> Result<()> {
        let schedules: Vec<&ramus_graph::Schedule> = batches.iter().map(|b| &b.schedule).collect();
        self.engine
            .prepare_window(&self.model, &schedules)
            .map_err(device_err)
    }

    fn local_step(&mut self, batch: Option<&Batch<'_>>) -> Result<LocalStep> {
        self.evaluated = None;
        let (loss, rows, lists) = match batch {
            Some(batch) => {
                let model = &self.model;
                let launched = self
                    .engine
                    .launch_prepared(&batch.schedule)
                    .map_err(device_err)?;
                let earlier = match launched {
                    true => None,
                    false => self
                        .engine
                        .submit_scheduled(model, &batch.schedule, Instant::now())
                        .map_err(device_err)?,
                };
                if earlier.is_some() {
                    return Err(ExecError::Device(
                        "a data-parallel step found an earlier batch in flight".into(),
                    ));
                }
                let step = self
                    .engine
                    .latest()
                    .map_err(device_err)?
                    .ok_or_else(|| ExecError::Device("the batch has no loss".into()))?;
                let rows = head_vertices(model.head.rows, &batch.schedule).len();
                let params = match &self.split {
                    Some(split) => &split.row_params,
                    None => return Err(ExecError::Config("not split".into())),
                };
                let lists = touched_rows(model, &batch.schedule, params.iter());
                (step.loss, rows, lists)
            }
            None => {
                // nothing ran: wait for the last update, whose status is read next
                self.engine.synchronize().map_err(device_err)?;
                let params = &self.split()?.row_params;
                (0.0, 0, params.iter().map(|&p| (p, Vec::new())).collect())
            }
        };
        let previous = self.settle_split()?;
        let split = self.split()?;
        split.previous = previous;
        let row_sets = row_sets_of(&lists);
        split.rows = lists;
        Ok(LocalStep {
            loss,
            rows,
            row_sets,
        })
    }

    fn global_step(
        &mut self,
        collective: &mut dyn Collective<f32>,
        _batch: Option<&Batch<'_>>,
        step: GlobalStep,
    ) -> Result<Vec<StepOutcome>> {
        let mut rows = std::mem::take(&mut self.split()?.rows);
        take_united_rows(&mut rows, step.row_sets)?;
        let buffers = self.engine.grad_buffers(&self.model).map_err(device_err)?;
        let buffers = buffers.into_iter().map(GradBuffer::Device).collect();
        collective.sum_buffers(buffers, step.scale)?;
        let mut lists = Vec::with_capacity(rows.len());
        for (_, list) in &rows {
            lists.push(self.engine.upload_words(list).map_err(device_err)?);
        }
        let touched = rows
            .iter()
            .zip(&lists)
            .map(|((_, list), buffer)| buffer.view().slice(0..list.len()))
            .collect::<crate::error::Result<Vec<_>>>()
            .map_err(device_err)?;
        let slot = self.optimizer()?.loss_slot().map_err(device_err)?;
        self.engine
            .upload_scalar(step.loss as f32, slot)
            .map_err(device_err)?;
        let stream = self.engine.stream().clone();
        if let Some(lr) = self.split()?.rates.pop_front() {
            self.config.set_lr(lr)?;
        }
        let config = self.config;
        let opt = self.optimizer()?;
        opt.set_config(&config).map_err(device_err)?;
        opt.step(&stream, &touched, Some(slot), false)
            .map_err(device_err)?;
        self.engine.zero_grads(&self.model).map_err(device_err)?;
        let split = self.split()?;
        split.lists = lists;
        split.loss = Some(step.loss);
        Ok(split.previous.take().into_iter().collect())
    }
}
