//! Preparing a batch on any thread: lowered ([`unroll_batch`]), levelled
//! and encoded into scripts, its words staged for the device.

use std::sync::Arc;
use std::time::Instant;

use rand_chacha::ChaCha8Rng;

use ramus_core::vpps::Scheduler;
use ramus_core::Model;
use ramus_graph::Schedule;

use super::batch::PreparedBatch;
use super::sizes;
use super::PersistentEngine;
use crate::error::Result;
use crate::persistent::program::PersistentProgram;
use crate::persistent::unroll::{unroll, Lowering};
use crate::pinned::PinnedBuffer;

/// What preparing a batch reads: the model, its program and the variant
/// (index and scheduler) the batch is for. Nothing the device changes, and
/// nothing borrowed from the engine, so batches are prepared on any thread
/// while the engine launches the ones already prepared.
pub(super) struct PrepareFor<'a> {
    pub(super) model: &'a Model,
    pub(super) prog: Arc<PersistentProgram>,
    pub(super) variant: usize,
    pub(super) scheduler: Arc<Scheduler>,
    pub(super) lowering: Lowering,
    pub(super) host_items: usize,
}

impl<'a> PrepareFor<'a> {
    /// For batches of `model` on `engine`'s active variant.
    pub(super) fn new(model: &'a Model, engine: &PersistentEngine) -> Self {
        let variant = engine.active;
        PrepareFor {
            model,
            prog: Arc::clone(&engine.prog),
            variant,
            scheduler: Arc::clone(&engine.variants[variant].scheduler),
            lowering: Lowering {
                grads_in_registers: engine.variants[variant].kernel.plan().grads_in_registers,
                defer_updates: engine.defer_updates,
            },
            host_items: engine.host_items,
        }
    }

    /// Lowers, levels and encodes one batch and stages its words (host
    /// words, scripts, update scripts: the pool's order from the upload
    /// region on) in slot `slot` (`staging`); `started` is when the host
    /// began preparing it.
    pub(super) fn prepare(
        &self,
        schedule: &Schedule,
        rng: &mut ChaCha8Rng,
        slot: usize,
        staging: &mut PinnedBuffer,
        started: Instant,
    ) -> Result<PreparedBatch> {
        let scheduler = &self.scheduler;
        let mut batch = unroll(
            self.model,
            &self.prog,
            schedule,
            self.lowering,
            scheduler.vpps,
            self.host_items,
            rng,
        )?;
        let tasks = batch.graph.len();
        let (launches, updates) = sizes::schedule_batch(scheduler, &mut batch, self.lowering)?;
        let update_words = updates.as_ref().map_or(&[][..], |u| &u.packed.words[..]);
        let mut parts = vec![&batch.upload[..]];
        parts.extend(
            launches
                .iter()
                .filter_map(|l| Some(&l.scripts.as_ref()?.packed.words[..])),
        );
        parts.push(update_words);
        // waits for this slot's previous upload to have been copied
        let host = staging.host_mut::<u32>(parts.iter().map(|p| p.len()).sum())?;
        let mut at = 0;
        for words in parts {
            host[at..at + words.len()].copy_from_slice(words);
            at += words.len();
        }
        // the task graphs and host words are staged: freed here, in the
        // preparing threads, not one batch after another (tens of thousands
        // of small vectors each) on the thread that launches the window
        drop(std::mem::take(&mut batch.matrix_updates));
        drop(std::mem::take(&mut batch.upload));
        Ok(PreparedBatch {
            variant: self.variant,
            slot,
            tasks,
            batch,
            launches,
            updates,
            host_seconds: started.elapsed().as_secs_f64(),
        })
    }
}
