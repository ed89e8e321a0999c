//! The training contract: [`TrainEngine`], which the training and
//! evaluation loops drive, and [`TrainState`], what a run's state is when
//! read back or restored. Each engine crate implements the contract for its
//! engines (the CPU batched engine in `ramus-cpu`, the CUDA batched and
//! persistent engines in `ramus-cuda`), so `ramus-nn`'s trainer runs on
//! whichever it is given.
//!
//! A training engine is built for one model and owns the run's training
//! state: the parameters, the optimizer (its settings, moments and step
//! count) and the dropout stream. Where the truth lives is the engine's
//! type: a host engine holds a [`HostState`] and updates it in place; a
//! device engine holds the state on its device. Either way the one way to
//! read the state is [`TrainEngine::state`], and the one way to replace it
//! is [`TrainEngine::restore`] (a resumed run).

use ramus_core::{Grads, HeadRows, Model, Params, Real};
use rand_chacha::ChaCha8Rng;

use crate::batch::{Batch, ForwardOutput, Mode};
use crate::error::{ExecError, Result};
use crate::nonfinite::NonFiniteStep;
use crate::optim::{Optimizer, OptimizerConfig};

/// What came back of one training step: its loss, or why it was not
/// applied (its loss or a gradient was not finite).
pub type StepOutcome = std::result::Result<f64, NonFiniteStep>;

/// A step's result as a [`StepOutcome`]: a non-finite step
/// ([`ExecError::NonFinite`]) is an outcome, any other error stays an error.
pub fn step_outcome(result: Result<f64>) -> Result<StepOutcome> {
    match result {
        Ok(loss) => Ok(Ok(loss)),
        Err(ExecError::NonFinite(fault)) => Ok(Err(fault.step)),
        Err(e) => Err(e),
    }
}

/// A training run's state, as [`TrainEngine::state`] reads it back and
/// [`TrainEngine::restore`] takes it: what a resumable checkpoint saves.
#[derive(Clone, Debug)]
pub struct TrainState<T> {
    /// The parameters (with their buffers, e.g. running statistics).
    pub params: Params<T>,
    /// The optimizer: its settings, moments and step count.
    pub optimizer: Optimizer<T>,
    /// The stream the dropout masks are drawn from, where it stands.
    pub dropout: ChaCha8Rng,
}

impl<T: Real> TrainState<T> {
    /// Refuses a state that does not fit an engine for `model` updating
    /// with `config`: other parameter shapes, or another kind of update.
    pub fn check_fits(&self, model: &Model, config: &OptimizerConfig) -> Result<()> {
        let values = &self.params.values;
        if values.len() != model.params.len() {
            return Err(ExecError::Config(format!(
                "restored state has {} parameter tensors for model `{}` of {}",
                values.len(),
                model.name,
                model.params.len()
            )));
        }
        for (t, spec) in values.iter().zip(&model.params) {
            if t.shape() != spec.shape.as_slice() {
                return Err(ExecError::Config(format!(
                    "restored parameter `{}` is {:?}, the model's is {:?}",
                    spec.name,
                    t.shape(),
                    spec.shape
                )));
            }
        }
        if self.optimizer.config.kind != config.kind {
            return Err(ExecError::Config(format!(
                "restored optimizer is {:?}, the engine was built for {:?}",
                self.optimizer.config.kind, config.kind
            )));
        }
        Ok(())
    }
}

/// Training state held on the host and updated in place by a host
/// engine's steps: the parameters, their gradient buffer and the optimizer.
#[derive(Clone, Debug)]
pub struct HostState<T> {
    pub params: Params<T>,
    /// The last step's gradients (scratch: cleared before each backward pass).
    pub grads: Grads<T>,
    pub optimizer: Optimizer<T>,
}

impl<T: Real> HostState<T> {
    /// `params` of `model`, zero gradients and a fresh optimizer.
    pub fn new(model: &Model, params: Params<T>, config: OptimizerConfig) -> Self {
        let optimizer = Optimizer::new(config, &params);
        HostState {
            grads: Grads::zeros(model),
            params,
            optimizer,
        }
    }
}

/// A training engine: built for one model, it owns the run's training state
/// (see the [module](self) docs) and runs forward passes on its current
/// parameters and training steps that update them.
///
/// Steps are submitted ([`submit`](Self::submit)) and their outcomes come
/// back in submission order, possibly later (an engine that overlaps the
/// host's preparation of the next batch with the device's work on this
/// one, or that learns whether a step's gradients were finite only with
/// the next step); [`finish`](Self::finish) waits for the rest. Forward
/// passes, [`state`](Self::state) and [`restore`](Self::restore) need every
/// submitted step finished and refuse otherwise.
pub trait TrainEngine<T: Real> {
    /// Short name for reports, e.g. `cpu-batched`.
    fn name(&self) -> &'static str;

    /// The model this engine was built for.
    fn model(&self) -> &Model;

    /// Forward pass on the current parameters with the head on `rows`.
    /// `Mode::Train` draws dropout masks (the stream moves on) but updates
    /// nothing (the running statistics it computes are dropped).
    fn forward_rows(
        &mut self,
        batch: &Batch<'_>,
        mode: Mode,
        rows: HeadRows,
    ) -> Result<ForwardOutput<T>>;

    /// Forward pass with the head on the model's own rows.
    fn forward(&mut self, batch: &Batch<'_>, mode: Mode) -> Result<ForwardOutput<T>> {
        let rows = self.model().head.rows;
        self.forward_rows(batch, mode, rows)
    }

    /// Starts training steps on `batches`, in order: forward, backward and
    /// one optimizer step each. A step whose loss or a gradient is not
    /// finite is not applied (parameters, running statistics and optimizer
    /// state stay as they were) where [`skips_nonfinite`](Self::skips_nonfinite)
    /// holds. Returns the outcomes that came back meanwhile (of these or
    /// earlier steps), oldest first.
    fn submit(&mut self, batches: &[Batch<'_>]) -> Result<Vec<StepOutcome>>;

    /// Waits for every submitted step and returns the outcomes not
    /// returned yet, in submission order.
    fn finish(&mut self) -> Result<Vec<StepOutcome>>;

    /// One step, waiting for its outcome: its loss, or
    /// [`ExecError::NonFinite`] for a step not applied (or for an earlier
    /// step still in flight that was not).
    fn train_step(&mut self, batch: &Batch<'_>) -> Result<f64> {
        let mut outcomes = self.submit(std::slice::from_ref(batch))?;
        outcomes.extend(self.finish()?);
        let last = outcomes
            .pop()
            .ok_or_else(|| ExecError::Config("the training step left no outcome".into()))?;
        if let Some(Err(step)) = outcomes.into_iter().find(|o| o.is_err()) {
            return Err(step.into());
        }
        last.map_err(Into::into)
    }

    /// How many batches [`submit`](Self::submit) takes at once to best
    /// effect (an engine that prepares several batches in parallel); 1 by
    /// default.
    fn lookahead(&self) -> usize {
        1
    }

    /// Whether a non-finite step leaves the parameters and optimizer state
    /// as they were (every engine but one whose update runs inside its
    /// training kernel, which can only stop).
    fn skips_nonfinite(&self) -> bool {
        true
    }

    /// Starts the dropout stream from `seed`.
    fn set_seed(&mut self, seed: u64);

    /// Sets the learning rate of every step submitted from now on (a
    /// schedule; the other optimizer settings stay). Refuses a rate that
    /// is negative or not finite.
    fn set_lr(&mut self, lr: f64) -> Result<()>;

    /// The learning rates of the next `lrs.len()` steps submitted, one
    /// each in submission order (a schedule that changes the rate every
    /// step, for an engine that takes several batches a
    /// [`submit`](Self::submit): see [`lookahead`](Self::lookahead)); the
    /// steps after them keep the last. An engine that takes its steps one
    /// at a time ([`lookahead`](Self::lookahead) 1, the default) is given
    /// one rate at a time, and refuses different rates at once.
    fn set_step_lrs(&mut self, lrs: &[f64]) -> Result<()> {
        match lrs {
            [] => Ok(()),
            [first, rest @ ..] if rest.iter().all(|lr| lr == first) => self.set_lr(*first),
            _ => Err(ExecError::Config(format!(
                "the {} engine takes one learning rate for the steps of a submit, given {}",
                self.name(),
                lrs.len()
            ))),
        }
    }

    /// Makes parameter `p`'s step take the learning rate times `scales[p]`
    /// (0: the parameter is not updated; empty: 1 for every parameter),
    /// e.g. frozen or slower embedding tables. A setting of the run, not
    /// of its state: [`restore`](Self::restore) keeps it. An engine whose
    /// update cannot take a multiplier somewhere refuses it, naming the
    /// parameter.
    fn set_lr_scales(&mut self, scales: &[f64]) -> Result<()>;

    /// The training state after every step submitted so far: the
    /// parameters, the optimizer and the dropout stream, read back from
    /// wherever the engine keeps them. Refused while steps are in flight
    /// (call [`finish`](Self::finish) first, so that no outcome is lost).
    fn state(&mut self) -> Result<TrainState<T>>;

    /// Makes `state` the engine's (a resumed run): the next step continues
    /// from these parameters, optimizer moments, step count and dropout
    /// stream. The optimizer's settings must be the ones the engine was
    /// built with. Refused while steps are in flight.
    fn restore(&mut self, state: TrainState<T>) -> Result<()>;

    /// One line on how the last training step used device memory (what a
    /// device engine swapped), for logs; `None` when there is nothing to say.
    fn memory_report(&self) -> Option<String> {
        None
    }

    /// One line on where the training steps' time went since the last
    /// call, for logs (and the count starts again); `None` when the engine
    /// does not measure it.
    fn timing_report(&mut self) -> Option<String> {
        None
    }

    /// This engine's rank and the number of ranks training together
    /// (data parallelism, see [`crate::data_parallel`]); `(0, 1)` alone.
    fn ranks(&self) -> (usize, usize) {
        (0, 1)
    }

    /// Replaces `values` with their sums over the ranks training together
    /// (evaluation counts, losses); nothing to do alone.
    fn sum_over_ranks(&mut self, values: &mut [f64]) -> Result<()> {
        let _ = values;
        Ok(())
    }

    /// Makes every rank's buffers (batch normalisation's running
    /// statistics, which each rank blends from its own batches) their mean
    /// over the ranks, so that every rank evaluates and saves the same
    /// model; called by every rank at the same point. Nothing to do alone.
    fn sync_buffers(&mut self) -> Result<()> {
        Ok(())
    }

    /// A training step of a data-parallel run in which this rank has no
    /// graphs (a short last global batch): it still takes part in the
    /// step's sums. Refused by an engine that trains alone.
    fn submit_idle(&mut self) -> Result<Vec<StepOutcome>> {
        Err(ExecError::Config(format!(
            "the {} engine trains alone: a step without graphs means nothing to it",
            self.name()
        )))
    }

    /// Whether each step needs its plan first
    /// ([`set_step_plans`](Self::set_step_plans)): a data-parallel engine's
    /// (several ranks, gradient accumulation, or a split update on one
    /// device).
    fn takes_step_plans(&self) -> bool {
        false
    }

    /// The plans of the next steps of a data-parallel run, one a step in
    /// order (see [`crate::step_plan::StepPlan`]), set before their
    /// batches are submitted. Refused by an engine that trains alone.
    fn set_step_plans(&mut self, plans: Vec<crate::step_plan::StepPlan>) -> Result<()> {
        let _ = plans;
        Err(ExecError::Config(format!(
            "the {} engine trains alone: it takes no data-parallel step plans",
            self.name()
        )))
    }

    /// Device memory this engine can still take, in bytes (what the
    /// device has free plus what its pool holds unused, within its
    /// budget), so that a command can check ahead that a run fits; `None`
    /// for engines that allocate on the host.
    fn device_memory_room(&self) -> Option<u64> {
        None
    }
}

/// The error of [`TrainEngine::state`], [`TrainEngine::restore`] or a
/// forward pass called while steps are in flight.
pub fn steps_in_flight(engine: &str, call: &str) -> ExecError {
    ExecError::Config(format!(
        "{call} on the {engine} engine with training steps in flight: call finish() first"
    ))
}
