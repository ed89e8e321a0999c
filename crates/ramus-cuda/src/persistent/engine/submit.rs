//! Submitting batches to a [`PersistentEngine`]: one at a time or a window
//! prepared in parallel, launched in order behind the batches still running,
//! and their steps read back.

use std::time::Instant;

use cudarc::driver::sys::CUevent_flags;
use rayon::prelude::*;

use ramus_core::Model;
use ramus_graph::{InputGraph, Schedule};

use super::batch::{schedule_graphs, PreparedBatch};
use super::options::{model_err, PersistentStep};
use super::prepare::PrepareFor;
use super::{Pending, PersistentEngine, Slot};
use crate::error::{InCall, Result};
use crate::persistent::unroll::dropout_draws;
use crate::pinned::PinnedBuffer;

impl PersistentEngine {
    /// Trains on one batch: forward, backward and the optimizer step in one
    /// kernel launch. Returns once this batch's loss is back (see
    /// [`submit`](Self::submit) for the overlapped form).
    pub fn train_batch(&mut self, model: &Model, graphs: &[&InputGraph]) -> Result<PersistentStep> {
        self.submit(model, graphs)?;
        self.latest()?
            .ok_or_else(|| model_err("the submitted batch has no loss"))
    }

    /// VPPS' training call: prepares and enqueues one batch (forward,
    /// backward and update in one launch, or a few around host GEMMs) and returns the *previous*
    /// batch's step, if one was pending (the oldest pending one after a
    /// [`submit_many`](Self::submit_many)) — so the host prepares the next
    /// batch while the device runs this one. [`latest`](Self::latest)
    /// waits for the last one.
    pub fn submit(
        &mut self,
        model: &Model,
        graphs: &[&InputGraph],
    ) -> Result<Option<PersistentStep>> {
        let started = Instant::now();
        let schedule = schedule_graphs(model, graphs)?;
        self.submit_scheduled(model, &schedule, started)
    }

    /// [`submit`](Self::submit) for a batch already scheduled (levels);
    /// `started` is when the host began preparing it.
    pub fn submit_scheduled(
        &mut self,
        model: &Model,
        schedule: &Schedule,
        started: Instant,
    ) -> Result<Option<PersistentStep>> {
        self.check_model(model)?;
        self.take_up_kernel(false)?;
        let slot = self.free_slots(1)?[0];
        let prepare = PrepareFor::new(model, self);
        let mut staging = self.take_staging(slot)?;
        let prepared = prepare.prepare(schedule, &mut self.rng, slot, &mut staging, started);
        self.slots[slot].staging = Some(staging);
        self.enqueue(prepared?)?;
        if self.pending.len() > 1 {
            self.pop_oldest().map(Some)
        } else {
            Ok(None)
        }
    }

    /// Submits a window of batches (each a list of graphs): schedules,
    /// lowers and encodes all of them in parallel on the host's cores,
    /// queues them in order behind the batches still running, and returns
    /// the steps of every batch submitted *before* this call, oldest first
    /// (waiting for them) — so the host prepares window `k + 1` while the
    /// device runs window `k`. Dropout masks are drawn exactly as one
    /// [`submit`](Self::submit) per batch would draw them.
    /// [`finish`](Self::finish) returns the last window's steps.
    pub fn submit_many(
        &mut self,
        model: &Model,
        batches: &[Vec<&InputGraph>],
    ) -> Result<Vec<PersistentStep>> {
        let started = Instant::now();
        let schedules = batches
            .par_iter()
            .with_max_len(1)
            .map(|graphs| schedule_graphs(model, graphs))
            .collect::<Result<Vec<Schedule>>>()?;
        let refs: Vec<&Schedule> = schedules.iter().collect();
        self.submit_many_scheduled(model, &refs, started)
    }

    /// [`submit_many`](Self::submit_many) for batches already scheduled;
    /// `started` is when the host began preparing them. While a bridge
    /// kernel trains (see [`PersistentOptions::bridge`](super::PersistentOptions::bridge)), the batches go
    /// one at a time, as [`submit`](Self::submit)s, and the steps returned
    /// are those of every batch but the last one submitted.
    pub fn submit_many_scheduled(
        &mut self,
        model: &Model,
        schedules: &[&Schedule],
        started: Instant,
    ) -> Result<Vec<PersistentStep>> {
        self.check_model(model)?;
        self.take_up_kernel(false)?;
        if self.awaited.is_some() {
            // a bridge kernel trains one batch at a time (two in flight),
            // so that the kernel proper takes over as soon as it is ready:
            // a bridge batch can take a hundred times as long
            // (each batch's host time from its own start: once the kernel
            // proper takes over, the search weighs it)
            let mut steps = Vec::new();
            for schedule in schedules {
                steps.extend(self.submit_scheduled(model, schedule, Instant::now())?);
            }
            return Ok(steps);
        }
        // each batch's dropout masks continue the stream where the previous
        // batch's end (two words per draw)
        let mut rngs = Vec::with_capacity(schedules.len());
        for s in schedules {
            rngs.push(self.rng.clone());
            let words = 2 * dropout_draws(model, s);
            self.rng.set_word_pos(self.rng.get_word_pos() + words);
        }
        // each batch staged in a slot of its own by the thread preparing it;
        // the batches are prepared in parallel and each is launched as soon
        // as it and every batch before it are ready (not when the slowest of
        // the window is), so the device waits on the host as little as the
        // host's stragglers allow
        let chosen = self.free_slots(schedules.len())?;
        let mut jobs = Vec::with_capacity(chosen.len());
        for ((i, &slot), rng) in chosen.iter().enumerate().zip(rngs) {
            match self.take_staging(slot) {
                Ok(staging) => jobs.push((i, slot, rng, staging)),
                Err(e) => {
                    for (_, slot, _, staging) in jobs {
                        self.slots[slot].staging = Some(staging);
                    }
                    return Err(e);
                }
            }
        }
        let prepare = PrepareFor::new(model, self);
        let earlier = self.pending.len();
        let (sender, ready) = std::sync::mpsc::channel();
        let launched = std::thread::scope(|scope| {
            scope.spawn(|| {
                jobs.into_par_iter()
                    // one batch per job, so that no thread holds two
                    // batches while another waits
                    .with_max_len(1)
                    .for_each_with(sender, |sender, (i, slot, mut rng, mut staging)| {
                        let prepared =
                            prepare.prepare(schedules[i], &mut rng, slot, &mut staging, started);
                        // the receiver outlives every job (it drains them all)
                        let _ = sender.send((i, slot, staging, prepared));
                    });
            });
            self.launch_in_order(ready, schedules.len())
        });
        launched?;
        (0..earlier).map(|_| self.pop_oldest()).collect()
    }

    /// Receives `count` prepared batches (window position, slot, its staging
    /// buffer, the batch) in any order, gives every slot its buffer back and
    /// launches the batches in window order as soon as each one and all
    /// before it are there; after a failed one, launches no more (and
    /// returns its error, once every buffer is back).
    pub(super) fn launch_in_order(
        &mut self,
        ready: std::sync::mpsc::Receiver<(usize, usize, PinnedBuffer, Result<PreparedBatch>)>,
        count: usize,
    ) -> Result<()> {
        let mut waiting: Vec<Option<PreparedBatch>> = (0..count).map(|_| None).collect();
        let mut next = 0;
        let mut failed = None;
        for (i, slot, staging, prepared) in ready {
            self.slots[slot].staging = Some(staging);
            match prepared {
                Ok(p) => waiting[i] = Some(p),
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
            while failed.is_none() && next < count {
                let Some(p) = waiting[next].take() else {
                    break;
                };
                if let Err(e) = self.enqueue(p) {
                    failed = Some(e);
                }
                next += 1;
            }
        }
        match failed {
            Some(e) => Err(e),
            None if next < count => Err(model_err(format!(
                "{} of {count} batches of the window were never prepared",
                count - next
            ))),
            None => Ok(()),
        }
    }

    /// Slot `slot`'s staging buffer (an error while it is lent out).
    pub(super) fn staging(&mut self, slot: usize) -> Result<&mut PinnedBuffer> {
        self.slots[slot]
            .staging
            .as_mut()
            .ok_or_else(|| model_err(format!("slot {slot}'s staging buffer is lent out")))
    }

    /// Slot `slot`'s staging buffer, lent to the thread preparing its batch.
    pub(super) fn take_staging(&mut self, slot: usize) -> Result<PinnedBuffer> {
        self.slots[slot]
            .staging
            .take()
            .ok_or_else(|| model_err(format!("slot {slot}'s staging buffer is already lent")))
    }

    /// Errors unless `model` is the one the engine was set up for.
    pub(super) fn check_model(&self, model: &Model) -> Result<()> {
        if crate::program::fingerprint(model) != self.fingerprint {
            return Err(model_err(
                "the batch is for a different model than the engine was set up for",
            ));
        }
        Ok(())
    }

    /// `n` slots no pending or prepared batch uses, ascending (new ones where too few
    /// are free).
    pub(super) fn free_slots(&mut self, n: usize) -> Result<Vec<usize>> {
        let mut free: Vec<usize> = (0..self.slots.len())
            .filter(|&i| !self.pending.iter().any(|p| p.slot == i))
            .filter(|&i| !self.prepared.iter().any(|(_, p)| p.slot == i))
            .take(n)
            .collect();
        while free.len() < n {
            let event = || {
                self.device
                    .context()
                    .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .in_call("cuEventCreate")
            };
            self.slots.push(Slot {
                staging: Some(PinnedBuffer::new(&self.device)?),
                scripts: None,
                scripts_copied: self.device.new_event()?,
                loss: PinnedBuffer::new(&self.device)?,
                fault: PinnedBuffer::new(&self.device)?,
                events: (event()?, event()?),
            });
            free.push(self.slots.len() - 1);
        }
        Ok(free)
    }

    /// Waits for the last submitted batch and returns its step (its loss
    /// included); `None` if every submitted batch was already returned.
    pub fn latest(&mut self) -> Result<Option<PersistentStep>> {
        Ok(self.finish()?.pop())
    }

    /// Waits for every submitted batch and returns the steps not returned
    /// yet, oldest first.
    pub fn finish(&mut self) -> Result<Vec<PersistentStep>> {
        (0..self.pending.len()).map(|_| self.pop_oldest()).collect()
    }

    /// The oldest pending batch's step with the loss its slot's copy
    /// brought back (waits for it); feeds the kernel's time to the `rpw`
    /// search.
    pub(super) fn pop_oldest(&mut self) -> Result<PersistentStep> {
        let Pending {
            slot,
            step,
            variant,
            ..
        } = self
            .pending
            .pop_front()
            .ok_or_else(|| model_err("no submitted batch is pending"))?;
        let loss = f64::from(self.slots[slot].loss.host::<f32>(1)?[0]);
        let nonfinite = self.slots[slot].fault.host::<u32>(1)?[0] != 0;
        let (start, end) = &self.slots[slot].events;
        let ms = start.elapsed_ms(end).in_call("cuEventElapsedTime")?;
        let seconds = f64::from(ms) / 1e3;
        self.last_kernel_seconds = Some(seconds);
        if self.variants[variant].kernel.report().bridge {
            self.bridge_batches.0 += 1;
            self.bridge_batches.1 += seconds;
        }
        if self.tuning.is_some() {
            // the search's cost of a batch: its device time and its share
            // of the host's preparation (one core's time over the batches
            // prepared in parallel). At large batches some models are
            // host-bound, and a plan with twice the processors cuts a wide
            // level into twice the instructions, so the device time alone
            // chose a plan that trained slower
            // (docs/benchmarks.md#persistent-engine-rpw-search)
            let share = step.host_seconds / crate::persistent::prepared_ahead() as f64;
            self.tune(variant, seconds + share)?;
        }
        Ok(PersistentStep {
            loss,
            nonfinite,
            kernel_seconds: seconds,
            ..step
        })
    }
}
