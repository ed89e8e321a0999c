//! The profile-guided `rpw` search (VPPS §III-A1) as batches come back,
//! and the hand-over from a bridge kernel to the kernel proper.

use ramus_codegen::persistent::KERNEL_NAME;

use super::options::model_err;
use super::variant::{build_variant, Variant, VariantChoice, TUNE_BATCHES};
use super::PersistentEngine;
use crate::error::{CudaError, Result};

impl PersistentEngine {
    /// One timed batch of `variant` for the `rpw` search, costing `cost`
    /// seconds: after [`TUNE_BATCHES`] of the current candidate, moves on
    /// to the next one (compiling it) or settles on the best and remembers
    /// it.
    pub(super) fn tune(&mut self, variant: usize, cost: f64) -> Result<()> {
        let Some(t) = self.tuning.as_mut() else {
            return Ok(());
        };
        if variant != self.active || self.variants[variant].kernel.report().bridge {
            // a batch of the previous candidate, still in flight, or of the
            // bridge kernel
            return Ok(());
        }
        t.samples.push(cost);
        if t.samples.len() < TUNE_BATCHES {
            return Ok(());
        }
        let mut timed = t.samples.split_off(1);
        t.samples.clear();
        timed.sort_by(f64::total_cmp);
        let median = timed[timed.len() / 2];
        if t.best.is_none_or(|(b, _)| median < b) {
            t.best = Some((median, variant));
        }
        let best = t.best.map_or(variant, |(_, v)| v);
        let next = t.at + 1;
        if !self.next_candidate(next).0 {
            self.settle(best);
        }
        Ok(())
    }

    /// Builds the search's candidates from index `from` on and makes the
    /// first that builds (spills nothing, fits, and plans differently from
    /// every variant timed) the one in use: whether one did, and the first
    /// error of those that did not build.
    pub(super) fn next_candidate(&mut self, from: usize) -> (bool, Option<CudaError>) {
        let candidates = match &self.tuning {
            Some(t) => t.candidates.clone(),
            None => return (false, None),
        };
        let mut failed = None;
        let plan_of = |v: &Variant| {
            let p = v.kernel.plan();
            (p.rpw, p.ctas_per_sm, p.grads_in_registers)
        };
        for (at, &choice) in candidates.iter().enumerate().skip(from) {
            let built = self.build_choice(choice);
            // a candidate that spills or does not fit is skipped, and so is
            // one whose plan was timed already
            let v = match built {
                Ok(v) => v,
                Err(e) => {
                    failed.get_or_insert(e);
                    continue;
                }
            };
            let timed = self
                .variants
                .iter()
                .any(|w| !w.kernel.report().bridge && plan_of(w) == plan_of(&v));
            if !timed {
                self.activate(v);
                if let Some(t) = self.tuning.as_mut() {
                    t.at = at;
                }
                return (true, failed);
            }
        }
        (false, failed)
    }

    /// The variant of `choice` (see [`build_variant`]).
    pub(super) fn build_choice(&self, choice: VariantChoice) -> Result<Variant> {
        build_variant(
            &self.device,
            &self.cache,
            &self.pool,
            &self.prog,
            &self.build,
            choice,
        )
    }

    /// Adds `variant` and makes it the one in use.
    pub(super) fn activate(&mut self, variant: Variant) {
        self.variants.push(variant);
        self.active = self.variants.len() - 1;
    }

    /// While a bridge kernel is in use: once the kernel proper it waits for
    /// is compiled (or at once, `wait`ing for it), builds it (with the
    /// `rpw` search running, its first candidate that builds) and makes it
    /// the one in use.
    pub(super) fn take_up_kernel(&mut self, wait: bool) -> Result<()> {
        let Some(awaited) = &self.awaited else {
            return Ok(());
        };
        if !wait && !self.cache.is_ready(&awaited.source, &[KERNEL_NAME])? {
            return Ok(());
        }
        let choice = awaited.choice;
        if self.tuning.is_some() {
            let (found, failed) = self.next_candidate(0);
            if !found {
                return Err(failed.unwrap_or_else(|| {
                    model_err("none of the rpw search's candidate kernels builds")
                }));
            }
        } else {
            let v = self.build_choice(choice)?;
            self.activate(v);
        }
        self.awaited = None;
        self.kernel_ready_seconds = Some(self.created.elapsed().as_secs_f64());
        Ok(())
    }

    /// Waits until the kernel proper is in use, where set-up left a bridge
    /// kernel training while it compiled (see [`PersistentOptions::bridge`](super::PersistentOptions::bridge)).
    pub fn wait_for_kernel(&mut self) -> Result<()> {
        self.take_up_kernel(true)
    }

    /// Ends the `rpw` search on variant `best` and remembers its plan's
    /// `rpw`, CTAs per SM and gradients' place.
    pub(super) fn settle(&mut self, best: usize) {
        self.tuning = None;
        self.active = best;
        let p = self.variants[best].kernel.plan();
        let text = format!(
            "{} {} {}\n",
            p.rpw,
            p.ctas_per_sm,
            u8::from(p.grads_in_registers)
        );
        if let Some(file) = &self.build.choice_file {
            // a failed write only costs the next run its search; a whole
            // one or none, never a torn one the next run would misread
            let _ = ramus_exec::atomic::write_atomic(file, text.as_bytes());
        }
    }

    /// The `rpw` variants compiled so far (the search's candidates; not
    /// a bridge kernel).
    pub fn compiled_rpws(&self) -> Vec<usize> {
        self.variants
            .iter()
            .filter(|v| !v.kernel.report().bridge)
            .map(|v| v.kernel.plan().rpw)
            .collect()
    }
}
