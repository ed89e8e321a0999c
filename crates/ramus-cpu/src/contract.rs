//! The CPU batched engine under the training contract
//! ([`ramus_exec::TrainEngine`]): [`CpuTrainer`] holds the model, the
//! engine and the run's [`HostState`], and each step updates that state in
//! place. [`CpuEngine`]'s own methods (taking the model and parameters on
//! each call) stay the reference evaluator the other engines are checked
//! against.

use ramus_core::{Grads, HeadRows, Model, Params, Real};
use ramus_exec::data_parallel::{
    reduce_host_grads, trained_params, Collective, SplitStep, StepPlan,
};
use ramus_exec::nonfinite::first_nonfinite;
use ramus_exec::{
    step_outcome, Batch, ExecError, ForwardOutput, HostState, Mode, NonFiniteStep, OptimizerConfig,
    Result, StepOutcome, TrainEngine, TrainState,
};

use crate::engine::CpuEngine;

/// The CPU batched engine as a training engine for one model: the
/// parameters, gradients and optimizer live on the host ([`HostState`]).
pub struct CpuTrainer<T> {
    engine: CpuEngine<T>,
    model: Model,
    state: HostState<T>,
    /// The gradients and loss of a step's batches so far, each scaled by
    /// its share of the step's head rows (gradient accumulation).
    accumulated: Option<(Grads<T>, f64)>,
    /// A gradient buffer kept from the last accumulated step, so that
    /// the next one allocates none.
    spare: Option<Grads<T>>,
    /// The buffers (running statistics) before an accumulated step's
    /// first batch, put back if the step is skipped as not finite.
    kept: Option<Vec<(usize, Vec<T>)>>,
}

impl<T: Real> CpuTrainer<T> {
    /// Trains `model` from `params` with a fresh optimizer of `config`.
    pub fn new(model: Model, params: Params<T>, config: OptimizerConfig) -> Self {
        Self::with_engine(CpuEngine::new(), model, params, config)
    }

    /// [`new`](Self::new) on an engine set up beforehand (token tables,
    /// spin helper, seed).
    pub fn with_engine(
        engine: CpuEngine<T>,
        model: Model,
        params: Params<T>,
        config: OptimizerConfig,
    ) -> Self {
        let state = HostState::new(&model, params, config);
        CpuTrainer {
            engine,
            model,
            state,
            accumulated: None,
            spare: None,
            kept: None,
        }
    }

    /// The run's state, updated in place by each step.
    pub fn host(&self) -> &HostState<T> {
        &self.state
    }

    /// The engine underneath (its settings and counters).
    pub fn engine_mut(&mut self) -> &mut CpuEngine<T> {
        &mut self.engine
    }

    /// Forward, backward and one optimizer step on the host; returns the
    /// loss. A step whose loss or a gradient is not finite is not applied
    /// (parameters, running statistics and optimizer state stay as they
    /// were) and is [`ExecError::NonFinite`], naming the first non-finite
    /// parameter.
    fn step(&mut self, batch: &Batch<'_>) -> Result<f64> {
        let loss = self.gradients(Some(batch))?;
        self.update(loss)
    }

    /// Forward and backward on `batch` into the gradient buffer (cleared
    /// first; `None`: zero gradients); returns the loss and head rows.
    fn gradients(&mut self, batch: Option<&Batch<'_>>) -> Result<f64> {
        self.gradients_and_rows(batch).map(|(loss, _)| loss)
    }

    fn gradients_and_rows(&mut self, batch: Option<&Batch<'_>>) -> Result<(f64, usize)> {
        let HostState { params, grads, .. } = &mut self.state;
        grads.clear();
        let Some(batch) = batch else {
            return Ok((0.0, 0));
        };
        let model = &self.model;
        let out = self.engine.forward(model, params, batch, Mode::Train)?;
        self.engine.backward(model, params, batch, grads)?;
        let loss = out
            .loss
            .ok_or_else(|| ExecError::Config("forward pass returned no loss".into()))?;
        Ok((loss, out.head_vertices.len()))
    }

    /// The optimizer step with the gradients in the buffer, reporting
    /// `loss`; not applied when `loss` or a gradient is not finite.
    fn update(&mut self, loss: f64) -> Result<f64> {
        let HostState {
            params,
            grads,
            optimizer,
        } = &mut self.state;
        // the running statistics this pass computed are dropped with its update
        if !loss.is_finite() || !optimizer.step_if_finite(params, grads) {
            return Err(NonFiniteStep {
                loss,
                param: first_nonfinite(&self.model, params, Some(grads)),
            }
            .into());
        }
        self.engine.apply_running_stats(params)?;
        Ok(loss)
    }
}

/// The CPU engine sums its gradients and loss on the host, through the
/// collective; a step's batches before its last add theirs to
/// `accumulated`.
impl<T: Real> SplitStep<T> for CpuTrainer<T> {
    fn split_step(
        &mut self,
        collective: &mut dyn Collective<T>,
        batch: Option<&Batch<'_>>,
        plan: &StepPlan,
    ) -> Result<Vec<StepOutcome>> {
        (self.engine).start_norm_step(batch.is_some(), &self.state.params)?;
        let (loss, rows) = self.gradients_and_rows(batch)?;
        let mut scale = plan.scale(rows)?;
        let mut loss = match rows {
            0 => 0.0,
            _ => loss * scale,
        };
        if !plan.last {
            if self.accumulated.is_none() {
                self.kept = Some(self.buffers());
            }
            // each batch's statistics blended into the running ones, as the
            // CUDA engine (and PyTorch) does
            self.engine.apply_running_stats(&mut self.state.params)?;
        }
        let grads = &mut self.state.grads;
        if !plan.last {
            let (sum, sum_loss) = self.accumulated.get_or_insert_with(|| {
                let mut sum = self
                    .spare
                    .take()
                    .unwrap_or_else(|| Grads::zeros(&self.model));
                sum.clear();
                (sum, 0.0)
            });
            sum.add_scaled(grads, T::from_f64(scale));
            *sum_loss += loss;
            return Ok(Vec::new());
        }
        if let Some((mut sum, sum_loss)) = self.accumulated.take() {
            // this batch's scaled share joins the sum: the step's gradients
            sum.add_scaled(grads, T::from_f64(scale));
            std::mem::swap(grads, &mut sum);
            self.spare = Some(sum);
            (scale, loss) = (1.0, loss + sum_loss);
        }
        let united = plan.host_row_sets(&trained_params(grads));
        reduce_host_grads(grads, collective, scale, &united)?;
        let mut loss = [loss];
        collective.sum_scalars(&mut loss)?;
        let updated = self.update(loss[0]);
        if let (Err(_), Some(kept)) = (&updated, self.kept.take()) {
            // a skipped step leaves no batch's statistics behind
            for (p, values) in kept {
                self.state.params.values[p]
                    .data_mut()
                    .copy_from_slice(&values);
            }
            self.state.params.touch();
        }
        self.kept = None;
        Ok(vec![step_outcome(updated)?])
    }
}

impl<T: Real> CpuTrainer<T> {
    /// Copies of the model's buffers (running statistics).
    fn buffers(&self) -> Vec<(usize, Vec<T>)> {
        let values = &self.state.params.values;
        (0..values.len())
            .filter(|&p| self.model.is_buffer(p))
            .map(|p| (p, values[p].data().to_vec()))
            .collect()
    }
}

impl<T: Real> TrainEngine<T> for CpuTrainer<T> {
    fn name(&self) -> &'static str {
        "cpu-batched"
    }
    fn model(&self) -> &Model {
        &self.model
    }
    fn forward_rows(
        &mut self,
        batch: &Batch<'_>,
        mode: Mode,
        rows: HeadRows,
    ) -> Result<ForwardOutput<T>> {
        let params = &self.state.params;
        self.engine
            .forward_rows(&self.model, params, batch, mode, rows)
    }
    fn submit(&mut self, batches: &[Batch<'_>]) -> Result<Vec<StepOutcome>> {
        batches
            .iter()
            .map(|batch| step_outcome(self.step(batch)))
            .collect()
    }
    fn finish(&mut self) -> Result<Vec<StepOutcome>> {
        Ok(Vec::new())
    }
    fn train_step(&mut self, batch: &Batch<'_>) -> Result<f64> {
        self.step(batch)
    }
    fn set_seed(&mut self, seed: u64) {
        self.engine.set_seed(seed);
    }
    /// The host optimizer reads its rate at every step.
    fn set_lr(&mut self, lr: f64) -> Result<()> {
        self.state.optimizer.config.set_lr(lr)
    }
    fn set_lr_scales(&mut self, scales: &[f64]) -> Result<()> {
        self.state.optimizer.set_lr_scales(scales)
    }
    fn state(&mut self) -> Result<TrainState<T>> {
        Ok(TrainState {
            params: self.state.params.clone(),
            optimizer: self.state.optimizer.clone(),
            dropout: self.engine.dropout_rng().clone(),
        })
    }
    fn restore(&mut self, state: TrainState<T>) -> Result<()> {
        state.check_fits(&self.model, &self.state.optimizer.config)?;
        let TrainState {
            params,
            optimizer,
            dropout,
        } = state;
        // the multipliers are the run's setting, not its state
        let scales = self.state.optimizer.lr_scales().to_vec();
        self.state.params = params;
        self.state.optimizer = optimizer;
        self.state.optimizer.set_lr_scales(&scales)?;
        self.engine.set_dropout_rng(dropout);
        Ok(())
    }
}
