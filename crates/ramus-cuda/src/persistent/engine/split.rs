//! What a data-parallel step needs of a [`PersistentEngine`]: batches that
//! end with every gradient in its pool slot (no update in the kernel), the
//! slots as the device optimizer and a collective see them, and their
//! zeroing once the update has read them.

use std::time::Instant;

use rayon::prelude::*;

use ramus_core::Model;
use ramus_exec::OptimizerConfig;
use ramus_graph::Schedule;

use super::options::model_err;
use super::prepare::PrepareFor;
use super::PersistentEngine;
use crate::error::Result;
use crate::optimizer::{DeviceOptimizer, GradLayout, ParamSlot};
use crate::persistent::unroll::dropout_draws;
use crate::pool::{DeviceView, PoolBuffer};

impl PersistentEngine {
    /// From the next batch on, a batch's kernel leaves every gradient in
    /// its pool slot and applies no update (the register gradients are
    /// flushed at the end of its last launch too): the caller sums them
    /// over the ranks and updates them with a [`DeviceOptimizer`] over
    /// [`param_slots`](Self::param_slots), then zeroes them.
    pub fn defer_updates(&mut self) -> Result<()> {
        if !self.pending.is_empty() {
            return Err(model_err(
                "updates can be deferred only with no batch in flight",
            ));
        }
        self.defer_updates = true;
        Ok(())
    }

    /// Prepares a window of batches (in order, each a schedule) in
    /// parallel on the host's cores without launching them: each
    /// [`launch_prepared`](Self::launch_prepared) launches the next, so a
    /// data-parallel rank, which launches one batch a step, prepares as the
    /// engine does alone. Dropout masks are drawn as by one submit per
    /// batch. While a bridge kernel trains, nothing is prepared ahead.
    pub(crate) fn prepare_window(&mut self, model: &Model, schedules: &[&Schedule]) -> Result<()> {
        self.check_model(model)?;
        self.take_up_kernel(false)?;
        if self.awaited.is_some() || !self.prepared.is_empty() {
            return Ok(());
        }
        let started = Instant::now();
        let mut jobs = Vec::with_capacity(schedules.len());
        for (&slot, s) in self.free_slots(schedules.len())?.iter().zip(schedules) {
            let rng = self.rng.clone();
            let words = 2 * dropout_draws(model, s);
            self.rng.set_word_pos(self.rng.get_word_pos() + words);
            jobs.push((slot, rng, s.num_vertices()));
        }
        let mut lent = Vec::with_capacity(jobs.len());
        for (slot, rng, vertices) in jobs {
            lent.push((slot, rng, vertices, self.take_staging(slot)?));
        }
        let prepare = PrepareFor::new(model, self);
        let done: Vec<_> = lent
            .into_par_iter()
            .zip(schedules.par_iter())
            .with_max_len(1)
            .map(|((slot, mut rng, vertices, mut staging), s)| {
                let prepared = prepare.prepare(s, &mut rng, slot, &mut staging, started);
                (slot, vertices, staging, prepared)
            })
            .collect();
        let mut failed = None;
        for (slot, vertices, staging, prepared) in done {
            self.slots[slot].staging = Some(staging);
            match prepared {
                Ok(p) if failed.is_none() => self.prepared.push_back((vertices, p)),
                Ok(_) => {}
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        match failed {
            Some(e) => {
                self.prepared.clear();
                Err(e)
            }
            None => Ok(()),
        }
    }

    /// Launches the next batch [`prepare_window`](Self::prepare_window)
    /// prepared, which must be `schedule`'s; `false` when none is waiting.
    pub(crate) fn launch_prepared(&mut self, schedule: &Schedule) -> Result<bool> {
        let Some((vertices, prepared)) = self.prepared.pop_front() else {
            return Ok(false);
        };
        if vertices != schedule.num_vertices() {
            self.prepared.clear();
            return Err(model_err(
                "a data-parallel step's batch is not the one prepared for it",
            ));
        }
        self.enqueue(prepared)?;
        Ok(true)
    }

    /// Where the last batch launched leaves its loss in the pool (a data-
    /// parallel step sums it over the ranks there, and its update checks
    /// it), until the next batch's kernel writes over it.
    pub(crate) fn newest_loss(&self) -> Result<DeviceView<f32>> {
        let at = self
            .pending
            .back()
            .ok_or_else(|| model_err("no batch is in flight"))?
            .loss_at;
        self.buffer.view().slice(at..at + 1)
    }

    /// Reads back every batch in flight but the newest (waiting for each):
    /// a data-parallel rank, whose steps' outcomes come from its updates,
    /// frees their slots and times their kernels.
    pub(crate) fn retire_older(&mut self) -> Result<()> {
        while self.pending.len() > 1 {
            self.pop_oldest()?;
        }
        Ok(())
    }

    /// The pool buffer's address: the views of
    /// [`param_slots`](Self::param_slots) hold until it changes (the pool
    /// grows for a larger batch).
    pub(crate) fn buffer_address(&self) -> u64 {
        self.buffer.view().device_ptr()
    }

    /// Every parameter's value and gradient slot in the pool, as the device
    /// optimizer updates them (`row_params`: the row-gradient tables).
    pub(crate) fn param_slots(
        &self,
        model: &Model,
        row_params: &[usize],
    ) -> Result<Vec<ParamSlot>> {
        let view = self.buffer.view();
        let layout = &self.prog.params;
        (0..model.params.len())
            .map(|p| {
                let len = layout.len[p];
                let grad = layout.grad[p]
                    .ok_or_else(|| model_err("a parameter without a gradient slot"))?;
                let value = layout.value[p];
                let kind = if model.is_buffer(p) {
                    GradLayout::Frozen
                } else if row_params.contains(&p) {
                    GradLayout::Rows {
                        width: model.params[p].shape.get(1).copied().unwrap_or(1),
                    }
                } else {
                    GradLayout::Dense
                };
                Ok(ParamSlot {
                    value: view.slice(value..value + len)?,
                    grad: view.slice(grad..grad + len)?,
                    layout: kind,
                })
            })
            .collect()
    }

    /// A device optimizer over [`param_slots`](Self::param_slots), its
    /// kernels from the engine's cache.
    pub(crate) fn device_optimizer(
        &self,
        model: &Model,
        config: &OptimizerConfig,
        row_params: &[usize],
    ) -> Result<DeviceOptimizer> {
        let slots = self.param_slots(model, row_params)?;
        DeviceOptimizer::new(&self.device, &self.pool, &self.cache, config, &slots)
    }

    /// Zeroes the trained parameters' gradient slots on the stream, after
    /// the update that read them.
    pub(crate) fn zero_grads(&self, model: &Model) -> Result<()> {
        let stream = self.device.stream();
        for g in self.grad_views(model)? {
            g.fill_zero(stream)?;
        }
        Ok(())
    }

    /// A new pool buffer of `n` floats (uninitialised).
    pub(crate) fn alloc_floats(&self, n: usize) -> Result<PoolBuffer<f32>> {
        self.pool.alloc::<f32>(n)
    }

    /// The trained parameters' gradient slots, while the pool does not
    /// move (see [`buffer_address`](Self::buffer_address)).
    pub(crate) fn grad_views(&self, model: &Model) -> Result<Vec<DeviceView<f32>>> {
        let view = self.buffer.view();
        let layout = &self.prog.params;
        (0..model.params.len())
            .filter(|&p| !model.is_buffer(p))
            .map(|p| {
                let at = layout.grad[p]
                    .ok_or_else(|| model_err("a parameter without a gradient slot"))?;
                view.slice(at..at + layout.len[p])
            })
            .collect()
    }

    /// A pool buffer of `len` words (at least one).
    pub(crate) fn alloc_words(&mut self, len: usize) -> Result<PoolBuffer<u32>> {
        self.pool.alloc::<u32>(len.max(1))
    }

    /// `words` into `dst` (as long), on the stream.
    pub(crate) fn upload_words(&mut self, words: &[u32], dst: DeviceView<u32>) -> Result<()> {
        if words.is_empty() {
            return Ok(());
        }
        let stream = self.device.stream().clone();
        self.transfer.upload_slice(words, dst, &stream)
    }

    /// `value` into the first float of `dst`, on the stream.
    pub(crate) fn upload_scalar(&mut self, value: f32, dst: DeviceView<f32>) -> Result<()> {
        let stream = self.device.stream().clone();
        self.transfer
            .upload_slice(&[value], dst.slice(0..1)?, &stream)
    }

    /// The device the engine runs on.
    pub fn device(&self) -> &std::sync::Arc<crate::CudaDevice> {
        &self.device
    }

    /// The stream the engine's work is ordered on.
    pub(crate) fn stream(&self) -> &std::sync::Arc<cudarc::driver::CudaStream> {
        self.device.stream()
    }

    /// Waits for everything queued on the stream.
    pub(crate) fn synchronize(&self) -> Result<()> {
        use crate::error::InCall;
        self.device
            .stream()
            .synchronize()
            .in_call("cuStreamSynchronize")
    }
}
