//! The persistent engine's training step split for data parallelism
//! ([`SplitStep`]). The update cannot stay in the kernel: the gradients
//! must be summed over the ranks first, and a kernel that waited for the
//! sum would hold every multiprocessor the sum's own kernel needs (the
//! persistent kernel runs one resident block per processor), so it would
//! never come. The kernel therefore ends with every gradient in its pool
//! slot ([`PersistentEngine::defer_updates`]); a step launches it, sums the
//! slots and the kernel's loss over the ranks (NCCL on the engine's
//! stream) and updates them with the batched engine's device optimizer,
//! whose moments then hold the optimizer state, without waiting for the
//! kernel: the host waits only for the update before, whose status brings
//! its summed loss back. A step whose summed loss or gradient is not
//! finite is skipped, as on the batched engine.

use std::time::Instant;

use ramus_exec::data_parallel::{Collective, DeviceBuffer, GradBuffer, SplitStep, StepPlan};
use ramus_exec::{Batch, ExecError, NonFiniteStep, Optimizer, Result, StepOutcome};

use super::train::Split;
use super::PersistentTrainer;
use crate::batch::head_vertices;
use crate::launch::RowMove;
use crate::optimizer::{DeviceOptimizer, StepStatus};
use crate::pool::{DeviceView, PoolBuffer};

fn device_err(e: crate::error::CudaError) -> ExecError {
    ExecError::Device(e.to_string())
}

/// `v` as a buffer ordered on `stream`.
fn on_stream(v: DeviceView<f32>, stream: &cudarc::driver::CudaStream) -> DeviceBuffer {
    DeviceBuffer {
        ptr: v.device_ptr(),
        len: v.len(),
        stream: stream.cu_stream() as u64,
    }
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
            row_params: self.model.row_grad_params().into_iter().collect(),
            optimizer: None,
            moments: Some(moments),
            updated: false,
            weight: None,
            loss_sum: None,
            lr_scales: Vec::new(),
            lists: Vec::new(),
            compact: None,
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
            if !split.lr_scales.is_empty() {
                opt.set_lr_scales(&split.lr_scales).map_err(device_err)?;
            }
            split.optimizer = Some((address, opt));
        }
        match &mut split.optimizer {
            Some((_, opt)) => Ok(opt),
            None => Err(ExecError::Device("device optimizer missing".into())),
        }
    }

    /// The last update's outcome: the loss summed over the ranks, or the
    /// step skipped as not finite (waits for the update).
    pub(super) fn settle_split(&mut self) -> Result<Option<StepOutcome>> {
        let Some(split) = self.split.as_mut() else {
            return Ok(None);
        };
        if !std::mem::take(&mut split.updated) {
            return Ok(None);
        }
        let status = match split.optimizer.as_mut() {
            Some((_, opt)) => opt.take_status().map_err(device_err)?,
            None => None,
        };
        match status {
            Some(StepStatus { applied, loss, .. }) => {
                let loss = f64::from(loss);
                Ok(Some(match applied {
                    true => Ok(loss),
                    false => Err(NonFiniteStep { loss, param: None }),
                }))
            }
            None => Err(ExecError::Device(
                "a data-parallel update's status was not read back".into(),
            )),
        }
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

    /// Launches the batch's kernel, then (once the last update is done:
    /// its outcome) enqueues the sum of the gradient slots and the loss
    /// over the ranks, the update and the slots' zeroing, without waiting
    /// for this step. The kernels of a step's batches (gradient
    /// accumulation) add into the same slots: before each, the slots are
    /// rescaled so that they hold the step's sum over the batch's weight
    /// (its share of the step's rows), which the sum over the ranks
    /// multiplies back.
    fn split_step(
        &mut self,
        collective: &mut dyn Collective<f32>,
        batch: Option<&Batch<'_>>,
        plan: &StepPlan,
    ) -> Result<Vec<StepOutcome>> {
        self.evaluated = None;
        // the update's rows, staged before the kernel: behind it, the copy
        // would make the next step's uploads wait for this step
        if plan.last {
            self.upload_rows(plan)?;
        }
        let rows = batch.map_or(0, |b| {
            head_vertices(self.model.head.rows, &b.schedule).len()
        });
        let weight = plan.scale(rows)?;
        let ran = match batch {
            Some(batch) if weight > 0.0 => {
                self.rescale_slots(weight)?;
                self.launch(batch)?;
                true
            }
            _ => {
                // nothing runs: wait for the last update
                self.engine.synchronize().map_err(device_err)?;
                self.engine.finish().map_err(device_err)?;
                false
            }
        };
        let previous = self.settle_split()?;
        let loss = self.loss_sum()?;
        let stream = self.engine.stream().clone();
        if ran {
            // the step's loss over this batch's weight, as the slots
            let kept = self.split()?.weight.map_or(0.0, |w| w / weight);
            let newest = self.engine.newest_loss().map_err(device_err)?;
            let launcher = &self.eval.launcher;
            launcher
                .scale_add(&stream, (loss, kept as f32), (newest, 1.0))
                .map_err(device_err)?;
            self.split()?.weight = Some(weight);
        }
        if !plan.last {
            return Ok(previous.into_iter().collect());
        }
        let mut weight = match self.split()?.weight.take() {
            Some(w) => w,
            None => {
                // no kernel of this step ran here: nothing to add
                self.engine.upload_scalar(0.0, loss).map_err(device_err)?;
                0.0
            }
        };
        if collective.world() == 1 && weight != 1.0 {
            // a group of one sums device buffers as they are: weigh them here
            self.scale_slots(weight as f32)?;
            self.eval
                .launcher
                .scale_add(&stream, (loss, weight as f32), (loss, 0.0))
                .map_err(device_err)?;
            weight = 1.0;
        }
        let (mut buffers, scatter) = self.summed_buffers(plan)?;
        buffers.push(on_stream(loss, &stream));
        collective.sum_buffers(
            buffers.into_iter().map(GradBuffer::Device).collect(),
            weight,
        )?;
        let launcher = &self.eval.launcher;
        launcher.move_rows(&stream, &scatter).map_err(device_err)?;
        self.update(plan, loss)?;
        Ok(previous.into_iter().collect())
    }
}

impl PersistentTrainer {
    /// Launches `batch`'s kernel (prepared ahead, or prepared now) and
    /// reads back the kernels before it (their losses are this rank's
    /// alone, not outcomes).
    fn launch(&mut self, batch: &Batch<'_>) -> Result<()> {
        let launched = self
            .engine
            .launch_prepared(&batch.schedule)
            .map_err(device_err)?;
        if !launched {
            self.engine
                .submit_scheduled(&self.model, &batch.schedule, Instant::now())
                .map_err(device_err)?;
        }
        self.engine.retire_older().map_err(device_err)
    }

    /// Before a kernel of `weight` adds to slots holding a step's sum
    /// over the last kernel's weight: the slots scaled to hold it over
    /// `weight` (nothing to do for a step's first kernel).
    fn rescale_slots(&mut self, weight: f64) -> Result<()> {
        let Some(last) = self.split()?.weight else {
            return Ok(());
        };
        self.scale_slots((last / weight) as f32)
    }

    /// The trained parameters' gradient slots multiplied by `factor`.
    fn scale_slots(&mut self, factor: f32) -> Result<()> {
        if factor == 1.0 {
            return Ok(());
        }
        let stream = self.engine.stream().clone();
        for g in self.engine.grad_views(&self.model).map_err(device_err)? {
            self.eval
                .launcher
                .scale_add(&stream, (g, factor), (g, 0.0))
                .map_err(device_err)?;
        }
        Ok(())
    }

    /// The device float a step's loss is summed in (allocated once).
    fn loss_sum(&mut self) -> Result<DeviceView<f32>> {
        if self.split()?.loss_sum.is_none() {
            let buffer = self.engine.alloc_floats(1).map_err(device_err)?;
            self.split()?.loss_sum = Some(buffer);
        }
        match &self.split()?.loss_sum {
            Some(b) => Ok(b.view()),
            None => Err(ExecError::Device("the loss sum is missing".into())),
        }
    }

    /// What a step sums over the ranks: each trained parameter's gradient
    /// slot, but of an embedding table only the rows `plan` touches (the
    /// same rows on every rank), gathered into a compact buffer; with the
    /// moves that put them back after the sum.
    fn summed_buffers(&mut self, plan: &StepPlan) -> Result<(Vec<DeviceBuffer>, Vec<RowMove>)> {
        let params = &self.model.params;
        let width = |p: usize| -> usize { params[p].shape.iter().skip(1).product() };
        // per table: its rows and their width
        let tables: Vec<(usize, usize)> = (plan.row_sets.iter())
            .map(|(p, rows)| (rows.len(), width(*p)))
            .collect();
        let need: usize = tables.iter().map(|(n, w)| n * w).sum();
        let fits = |b: &Option<PoolBuffer<f32>>| b.as_ref().is_some_and(|b| b.len() >= need);
        if !fits(&self.split()?.compact) {
            let buffer = self.engine.alloc_floats(need.max(1)).map_err(device_err)?;
            self.split()?.compact = Some(buffer);
        }
        let split = self.split()?;
        let compact = (split.compact.as_ref().map(|b| b.view()))
            .ok_or_else(|| ExecError::Device("the gathered rows' buffer is missing".into()))?;
        let lists = (tables.iter().zip(&split.lists))
            .map(|(&(n, _), b)| b.view().slice(0..n))
            .collect::<crate::error::Result<Vec<_>>>()
            .map_err(device_err)?;
        let model = &self.model;
        let views = self.engine.grad_views(model).map_err(device_err)?;
        let stream = self.engine.stream().clone();
        let trained = (0..model.params.len()).filter(|&p| !model.is_buffer(p));
        let (mut buffers, mut gather, mut scatter, mut at) = (Vec::new(), vec![], vec![], 0);
        for (p, view) in trained.zip(views) {
            let Some(i) = plan.row_sets.iter().position(|(q, _)| *q == p) else {
                buffers.push(on_stream(view, &stream));
                continue;
            };
            let (rows, w) = (lists[i], tables[i].1);
            let part = compact.slice(at..at + rows.len() * w).map_err(device_err)?;
            at += part.len();
            gather.push(RowMove::gather(part, view, rows, w));
            scatter.push(RowMove::scatter(view, part, rows, w));
            buffers.push(on_stream(part, &stream));
        }
        let launcher = &self.eval.launcher;
        launcher.move_rows(&stream, &gather).map_err(device_err)?;
        Ok((buffers, scatter))
    }

    /// `plan`'s row lists in the split state's buffers, one per table,
    /// each as long as its table (allocated once; a list's copy follows
    /// the last update that read the buffer, on the same stream).
    fn upload_rows(&mut self, plan: &StepPlan) -> Result<()> {
        for (i, (p, list)) in plan.row_sets.iter().enumerate() {
            if self.split()?.lists.len() <= i {
                let rows = self.model.params[*p].shape.first().copied().unwrap_or(0);
                let buffer = self
                    .engine
                    .alloc_words(rows.max(list.len()))
                    .map_err(device_err)?;
                self.split()?.lists.push(buffer);
            }
            let view = self.split()?.lists[i]
                .view()
                .slice(0..list.len())
                .map_err(device_err)?;
            self.engine.upload_words(list, view).map_err(device_err)?;
        }
        Ok(())
    }

    /// The update of a step whose gradient slots and `loss` hold the sums
    /// over the ranks: over `plan.row_sets` (uploaded by
    /// [`upload_rows`](Self::upload_rows)), checking `loss`; then the slots
    /// are zeroed.
    fn update(&mut self, plan: &StepPlan, loss: DeviceView<f32>) -> Result<()> {
        let touched = plan
            .row_sets
            .iter()
            .zip(&self.split()?.lists)
            .map(|((_, list), buffer)| buffer.view().slice(0..list.len()))
            .collect::<crate::error::Result<Vec<_>>>()
            .map_err(device_err)?;
        let stream = self.engine.stream().clone();
        if let Some(lr) = self.split()?.rates.pop_front() {
            self.config.set_lr(lr)?;
        }
        let config = self.config;
        let opt = self.optimizer()?;
        opt.set_config(&config).map_err(device_err)?;
        opt.step(&stream, &touched, Some(loss), false)
            .map_err(device_err)?;
        self.engine.zero_grads(&self.model).map_err(device_err)?;
        self.split()?.updated = true;
        Ok(())
    }
}
