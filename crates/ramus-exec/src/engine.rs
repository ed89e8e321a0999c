//! The engine interface the training and evaluation loops drive. Each engine
//! crate implements it for its engines (the CPU batched engine in
//! `ramus-cpu`, the CUDA engines in `ramus-cuda`), so `ramus-nn`'s trainer
//! runs on whichever it is given.

use ramus_core::{Grads, HeadRows, Model, Params, Real};
use rand_chacha::ChaCha8Rng;

use crate::batch::{Batch, ForwardOutput, Mode};
use crate::error::{ExecError, Result};
use crate::nonfinite::{first_nonfinite, NonFiniteStep};
use crate::optim::Optimizer;

/// What came back of one training step: its loss, or why it was not
/// applied (its loss or a gradient was not finite).
pub type StepOutcome = std::result::Result<f64, NonFiniteStep>;

/// [`Engine::train_step`]'s result as a [`StepOutcome`]: a non-finite step
/// is an outcome, any other error stays an error.
pub fn step_outcome(result: Result<f64>) -> Result<StepOutcome> {
    match result {
        Ok(loss) => Ok(Ok(loss)),
        Err(ExecError::NonFinite(fault)) => Ok(Err(fault.step)),
        Err(e) => Err(e),
    }
}

/// Runs batches of a model: forward (with the head on a chosen set of rows),
/// backward into host gradients, and a whole training step.
pub trait Engine<T: Real> {
    /// Short name for reports, e.g. `cpu-batched`.
    fn name(&self) -> &'static str;

    /// Forward pass with the head on `rows`.
    fn forward_rows(
        &mut self,
        model: &Model,
        params: &Params<T>,
        batch: &Batch<'_>,
        mode: Mode,
        rows: HeadRows,
    ) -> Result<ForwardOutput<T>>;

    /// Forward pass with the head on the model's own rows.
    fn forward(
        &mut self,
        model: &Model,
        params: &Params<T>,
        batch: &Batch<'_>,
        mode: Mode,
    ) -> Result<ForwardOutput<T>> {
        self.forward_rows(model, params, batch, mode, model.head.rows)
    }

    /// Backward pass of the last train-mode forward pass; adds parameter
    /// gradients into `grads`.
    fn backward(
        &mut self,
        model: &Model,
        params: &Params<T>,
        batch: &Batch<'_>,
        grads: &mut Grads<T>,
    ) -> Result<()>;

    /// Seeds the dropout masks.
    fn set_seed(&mut self, seed: u64);

    /// The stream the dropout masks are drawn from, where it stands after
    /// the steps submitted so far (a resumable checkpoint saves it; call
    /// after [`Engine::finish_train_steps`]).
    fn dropout_rng(&self) -> ChaCha8Rng;

    /// Continues the dropout masks from `rng` (a resumed run).
    fn set_dropout_rng(&mut self, rng: ChaCha8Rng);

    /// Copies the optimizer state the engine keeps itself (a device
    /// engine's moments and step count) into `optimizer`, for a checkpoint;
    /// call after [`Engine::finish_train_steps`]. Host engines update
    /// `optimizer` in place: a no-op.
    fn sync_host_optimizer(&mut self, optimizer: &mut Optimizer<T>) -> Result<()> {
        let _ = optimizer;
        Ok(())
    }

    /// Makes the engine's own optimizer state `optimizer`'s (a resumed
    /// run), before the next training step. A no-op for host engines.
    fn load_optimizer_state(&mut self, optimizer: &Optimizer<T>) -> Result<()> {
        let _ = optimizer;
        Ok(())
    }

    /// One line on how the last training step used device memory (what a
    /// device engine swapped), for logs; `None` when there is nothing to say.
    fn memory_report(&self) -> Option<String> {
        None
    }

    /// Device memory this engine can still take, in bytes (what the
    /// device has free plus what its pool holds unused, within its
    /// budget), so that a command can check ahead that a run fits; `None`
    /// for engines that allocate on the host.
    fn device_memory_room(&self) -> Option<u64> {
        None
    }

    /// Brings `params` up to date with the engine's own copy, for engines
    /// whose [`Engine::train_step`] updates parameters on a device (the host
    /// values then lag until this is called). A no-op for host engines.
    fn sync_host_params(&mut self, params: &mut Params<T>) -> Result<()> {
        let _ = params;
        Ok(())
    }

    /// Writes the running statistics the last train-mode forward pass
    /// computed (batch normalisation's running mean and variance, buffers
    /// of `params`) into `params`. Host engines keep them pending until
    /// this is called ([`Engine::train_step`] does, after its forward pass);
    /// device engines update their own copy during the pass (see
    /// [`Engine::sync_host_params`]), so the default does nothing.
    fn apply_running_stats(&mut self, params: &mut Params<T>) -> Result<()> {
        let _ = params;
        Ok(())
    }

    /// Forward, backward and one optimizer step; returns the loss. A step
    /// whose loss or a gradient is not finite is not applied (parameters,
    /// running statistics and optimizer state stay as they were) and is
    /// [`ExecError::NonFinite`], naming the first non-finite parameter.
    /// Engines that keep parameters on a device override this to update
    /// them there (see [`Engine::sync_host_params`]).
    fn train_step(
        &mut self,
        model: &Model,
        params: &mut Params<T>,
        grads: &mut Grads<T>,
        optimizer: &mut Optimizer<T>,
        batch: &Batch<'_>,
    ) -> Result<f64> {
        let out = self.forward(model, params, batch, Mode::Train)?;
        grads.clear();
        self.backward(model, params, batch, grads)?;
        let loss = out
            .loss
            .ok_or_else(|| ExecError::Config("forward pass returned no loss".into()))?;
        // the running statistics this pass computed are dropped with its update
        if !loss.is_finite() || !optimizer.step_if_finite(params, grads) {
            return Err(NonFiniteStep {
                loss,
                param: first_nonfinite(model, params, Some(grads)),
            }
            .into());
        }
        self.apply_running_stats(params)?;
        Ok(loss)
    }

    /// Whether a non-finite step leaves the parameters and optimizer state
    /// as they were (every engine but one whose update runs inside its
    /// training kernel, which can only stop).
    fn skips_nonfinite(&self) -> bool {
        true
    }

    /// Starts a training step whose outcome may come back later (an engine
    /// that overlaps the host's preparation of the next batch with the
    /// device's work on this one, as VPPS does, or that learns whether a
    /// step's gradients were finite only with the next step). Returns the
    /// outcome of the oldest step still in flight once it is known —
    /// outcomes come back in submission order — or `None` if none is yet.
    /// By default the step runs at once and returns its own outcome.
    fn submit_train_step(
        &mut self,
        model: &Model,
        params: &mut Params<T>,
        grads: &mut Grads<T>,
        optimizer: &mut Optimizer<T>,
        batch: &Batch<'_>,
    ) -> Result<Option<StepOutcome>> {
        step_outcome(self.train_step(model, params, grads, optimizer, batch)).map(Some)
    }

    /// How many batches the engine takes at once through
    /// [`submit_train_steps`](Engine::submit_train_steps) (an engine that
    /// prepares several batches in parallel); 1 by default.
    fn lookahead(&self) -> usize {
        1
    }

    /// Starts several training steps, in order (see
    /// [`submit_train_step`](Engine::submit_train_step)); returns the
    /// outcomes that came back meanwhile, oldest first. By default one step
    /// after the other.
    fn submit_train_steps(
        &mut self,
        model: &Model,
        params: &mut Params<T>,
        grads: &mut Grads<T>,
        optimizer: &mut Optimizer<T>,
        batches: &[Batch<'_>],
    ) -> Result<Vec<StepOutcome>> {
        let mut outcomes = Vec::new();
        for batch in batches {
            outcomes.extend(self.submit_train_step(model, params, grads, optimizer, batch)?);
        }
        Ok(outcomes)
    }

    /// Waits for every submitted step and returns the outcomes not
    /// returned yet, in submission order.
    fn finish_train_steps(&mut self) -> Result<Vec<StepOutcome>> {
        Ok(Vec::new())
    }
}
