//! The persistent engine as a training engine ([`TrainEngine`]), so the
//! trainer (and `ramus train --engine persistent`) drives it: training
//! steps go through the overlapped VPPS call (each returns the previous
//! batch's loss), and evaluation runs on the batched CUDA engine with the
//! parameters brought back from the device. The parameters and the
//! optimizer state live in the persistent engine's pool.
//!
//! Non-finite steps: the update runs inside the training kernel, so a step
//! cannot be held back ([`TrainEngine::skips_nonfinite`] is false: the trainer
//! refuses `skip-batch` up front). A batch whose loss comes back non-finite,
//! or whose update met a non-finite gradient or value (the kernel's fault
//! word, copied back with the loss), is reported with the first parameter
//! whose value is not finite (read back then).

use ramus_core::{Model, Params};
use ramus_exec::nonfinite::first_nonfinite;
use ramus_exec::{steps_in_flight, Batch, ForwardOutput, Mode, TrainEngine, TrainState};
use ramus_exec::{ExecError, NonFiniteStep, Optimizer, OptimizerConfig, StepOutcome};

use super::{PersistentEngine, PersistentOptions};
use crate::engine::{CudaEngine, CudaEngineOptions};
use crate::error::Result;
use crate::memory::{block_bytes, model_fits, DeviceCheck};
use crate::optimizer::DeviceOptimizer;
use crate::pool::PoolBuffer;
use ramus_exec::memory::{ActivationCost, DeviceNeed, Pass};

/// Batches the trainer hands the persistent engine at once: prepared in
/// parallel, one per core (2 to 16), while the device runs the window
/// before.
pub fn prepared_ahead() -> usize {
    std::env::var("RAMUS_PREPARED_AHEAD")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n: &usize| n >= 1)
        .unwrap_or_else(|| rayon::current_num_threads().clamp(2, 16))
}

/// A persistent trainer's data-parallel state.
pub(super) struct Split {
    /// The row-gradient tables, in declaration order.
    pub(super) row_params: Vec<usize>,
    /// The optimizer, with the pool address its slots were made for.
    pub(super) optimizer: Option<(u64, DeviceOptimizer)>,
    /// Optimizer state for the next optimizer built (the engine's at the
    /// start, or restored).
    pub(super) moments: Option<Optimizer<f32>>,
    /// Whether the last update's status (and summed loss) is unread.
    pub(super) updated: bool,
    /// Within a step (gradient accumulation): the weight of its last
    /// kernel, over which the slots and the loss sum hold the step's sums.
    pub(super) weight: Option<f64>,
    /// Where a step's loss is summed.
    pub(super) loss_sum: Option<PoolBuffer<f32>>,
    /// Per-parameter rate multipliers (empty: none).
    pub(super) lr_scales: Vec<f64>,
    /// Per row-gradient table, a buffer as long as the table holding the
    /// next (or last) update's rows, reused step after step.
    pub(super) lists: Vec<PoolBuffer<u32>>,
    /// The tables' touched rows, gathered for their sum over the ranks.
    pub(super) compact: Option<PoolBuffer<f32>>,
    /// The rates of the steps to come (a learning-rate schedule's), oldest
    /// first; none: the configured rate.
    pub(super) rates: std::collections::VecDeque<f64>,
}

/// Training on the persistent engine, evaluation on the batched one.
pub struct PersistentTrainer {
    /// Holds the parameters and the optimizer state (in its pool).
    pub(super) engine: PersistentEngine,
    pub(super) eval: CudaEngine,
    /// The model the engines were set up for.
    pub(super) model: Model,
    pub(super) config: OptimizerConfig,
    /// The parameters last read back for evaluation, until the next step.
    pub(super) evaluated: Option<Params<f32>>,
    /// One rank of a data-parallel run (see [`PersistentTrainer::split_updates`]).
    pub(super) split: Option<Split>,
}

/// What the evaluating (batched) engine allocates for the model: the
/// parameters and their gradient buffer, a block each.
fn evaluation_parts(model: &Model) -> [(&'static str, u64); 2] {
    let floats: usize = model
        .params
        .iter()
        .map(|p| p.shape.iter().product::<usize>())
        .sum();
    [
        ("the evaluating engine's parameters", block_bytes(floats)),
        ("its gradient buffer", block_bytes(floats)),
    ]
}

fn exec_err(e: crate::error::CudaError) -> ExecError {
    ExecError::Config(e.to_string())
}

impl PersistentTrainer {
    /// Sets both engines up for `model`, starting from `params`, updating
    /// with `optimizer` (its state lives on the device); refuses a model
    /// whose parameters cannot fit the device (see
    /// [`with_check`](Self::with_check)).
    pub fn new(
        model: &Model,
        params: &Params<f32>,
        optimizer: OptimizerConfig,
        options: &PersistentOptions,
    ) -> Result<Self> {
        Self::with_check(model, params, optimizer, options, &model_fits)
    }

    /// [`new`](Self::new), asking `check` before anything large is
    /// allocated whether the run fits the device (see
    /// [`PersistentEngine::with_check`]): what the persistent engine
    /// allocates, and beside it the evaluating engine's parameters, their
    /// gradient buffer and an evaluation batch ([`DeviceNeed::train_kept`]:
    /// the training batch's region stays while it evaluates).
    pub fn with_check(
        model: &Model,
        params: &Params<f32>,
        optimizer: OptimizerConfig,
        options: &PersistentOptions,
        check: DeviceCheck<'_>,
    ) -> Result<Self> {
        let both = |need: &DeviceNeed, room| {
            let mut need = need.clone();
            need.parts.extend(evaluation_parts(model));
            need.eval = Some(ActivationCost::new(model, Pass::Evaluate));
            need.train_kept = true;
            check(&need, room)
        };
        let engine = PersistentEngine::with_check(model, params, optimizer, options, &both)?;
        let mut eval_options = CudaEngineOptions {
            device: options.device,
            cache_dir: options.cache_dir.clone(),
            ..CudaEngineOptions::default()
        };
        eval_options.pool.max_bytes = options.memory_budget;
        let eval = CudaEngine::new(model, &eval_options)?;
        Ok(PersistentTrainer {
            engine,
            eval,
            model: model.clone(),
            config: optimizer,
            evaluated: None,
            split: None,
        })
    }

    /// The persistent engine itself.
    pub fn persistent(&self) -> &PersistentEngine {
        &self.engine
    }

    /// The outcome of a step that came back: a non-finite loss or update
    /// names the first parameter whose value is not finite (the parameters
    /// are read back, after the batches in flight).
    fn outcome(&mut self, step: &super::PersistentStep) -> ramus_exec::Result<StepOutcome> {
        if step.loss.is_finite() && !step.nonfinite {
            return Ok(Ok(step.loss));
        }
        let params = self.engine.params(&self.model).map_err(exec_err)?;
        Ok(Err(NonFiniteStep {
            loss: step.loss,
            param: first_nonfinite(&self.model, &params, None),
        }))
    }

    pub(super) fn check_idle(&self, call: &str) -> ramus_exec::Result<()> {
        match self.engine.in_flight() {
            0 => Ok(()),
            _ => Err(steps_in_flight("cuda-persistent", call)),
        }
    }

    fn outcomes(
        &mut self,
        steps: Vec<super::PersistentStep>,
    ) -> ramus_exec::Result<Vec<StepOutcome>> {
        steps.iter().map(|s| self.outcome(s)).collect()
    }
}

impl TrainEngine<f32> for PersistentTrainer {
    fn name(&self) -> &'static str {
        "cuda-persistent"
    }

    fn model(&self) -> &Model {
        &self.model
    }

    /// On the batched engine, with the parameters read back from the
    /// persistent engine's pool (once after each run of steps).
    fn forward_rows(
        &mut self,
        batch: &Batch<'_>,
        mode: Mode,
        rows: ramus_core::HeadRows,
    ) -> ramus_exec::Result<ForwardOutput<f32>> {
        self.check_idle("a forward pass")?;
        let params = match self.evaluated.take() {
            Some(params) => params,
            None => self.engine.params(&self.model).map_err(exec_err)?,
        };
        let out = self
            .eval
            .forward_rows(&self.model, &params, batch, mode, rows);
        self.evaluated = Some(params);
        Ok(out?)
    }

    fn submit(&mut self, batches: &[Batch<'_>]) -> ramus_exec::Result<Vec<StepOutcome>> {
        self.evaluated = None;
        let started = std::time::Instant::now();
        let steps = match batches {
            // one batch in flight behind the one submitted
            [batch] => {
                let previous = self
                    .engine
                    .submit_scheduled(&self.model, &batch.schedule, started)
                    .map_err(exec_err)?;
                previous.into_iter().collect()
            }
            _ => {
                let schedules: Vec<&ramus_graph::Schedule> =
                    batches.iter().map(|b| &b.schedule).collect();
                self.engine
                    .submit_many_scheduled(&self.model, &schedules, started)
                    .map_err(exec_err)?
            }
        };
        self.outcomes(steps)
    }

    fn finish(&mut self) -> ramus_exec::Result<Vec<StepOutcome>> {
        let steps = self.engine.finish().map_err(exec_err)?;
        if self.split.is_some() {
            // split: the outcomes are the updates', the kernels' losses this
            // rank's alone
            self.engine.synchronize().map_err(exec_err)?;
            return Ok(self.settle_split()?.into_iter().collect());
        }
        self.outcomes(steps)
    }

    fn lookahead(&self) -> usize {
        prepared_ahead()
    }

    /// Split for data parallelism, the update runs outside the kernel and
    /// a non-finite step is skipped.
    fn skips_nonfinite(&self) -> bool {
        self.split.is_some()
    }

    fn set_seed(&mut self, seed: u64) {
        self.engine.seed(seed);
        self.eval.set_seed(seed);
    }

    /// Each launch's update takes its rate as a kernel argument, read when
    /// the batch is enqueued.
    fn set_lr(&mut self, lr: f64) -> ramus_exec::Result<()> {
        self.config.set_lr(lr)?;
        self.engine.set_lr(lr).map_err(exec_err)
    }

    /// A window's batches are enqueued one after another, each taking the
    /// next rate.
    fn set_step_lrs(&mut self, lrs: &[f64]) -> ramus_exec::Result<()> {
        if let Some(split) = self.split.as_mut() {
            // split: the device optimizer takes each step's rate
            split.rates.extend(lrs.iter().copied());
        }
        self.engine.set_step_lrs(lrs).map_err(exec_err)?;
        if let Some(&last) = lrs.last() {
            self.config.set_lr(last)?;
        }
        Ok(())
    }

    /// The training kernel updates every parameter with the launch's one
    /// rate: multipliers other than 1 are refused, naming the parameter.
    fn set_lr_scales(&mut self, scales: &[f64]) -> ramus_exec::Result<()> {
        ramus_exec::optim::check_lr_scales(scales, self.model.params.len())?;
        if let Some(split) = self.split.as_mut() {
            // split: the device optimizer updates, each parameter at its rate
            split.lr_scales = scales.to_vec();
            if let Some((_, opt)) = split.optimizer.as_mut() {
                opt.set_lr_scales(scales).map_err(exec_err)?;
            }
            return Ok(());
        }
        match scales.iter().position(|&s| s != 1.0) {
            None => Ok(()),
            Some(p) => Err(ExecError::Config(format!(
                "the cuda-persistent engine updates every parameter with one learning rate \
                 inside its training kernel: parameter `{}` cannot take a multiplier of {} \
                 unless its updates are split out of the kernel (split_updates)",
                self.model.params[p].name, scales[p]
            ))),
        }
    }

    fn state(&mut self) -> ramus_exec::Result<TrainState<f32>> {
        self.check_idle("state()")?;
        let params = self.engine.params(&self.model).map_err(exec_err)?;
        let mut optimizer = Optimizer::new(self.config, &params);
        if !self.split_moments(&mut optimizer)? {
            self.engine
                .download_optimizer(&mut optimizer)
                .map_err(exec_err)?;
        }
        Ok(TrainState {
            params,
            optimizer,
            dropout: self.engine.dropout_rng().clone(),
        })
    }

    fn restore(&mut self, state: TrainState<f32>) -> ramus_exec::Result<()> {
        self.check_idle("restore()")?;
        state.check_fits(&self.model, &self.config)?;
        self.engine.upload_params(&state.params).map_err(exec_err)?;
        if !self.restore_split_moments(&state.optimizer) {
            self.engine
                .upload_optimizer(&state.optimizer)
                .map_err(exec_err)?;
        }
        self.engine.set_dropout_rng(state.dropout.clone());
        self.eval.set_dropout_rng(state.dropout);
        self.evaluated = Some(state.params);
        Ok(())
    }

    fn device_memory_room(&self) -> Option<u64> {
        self.eval.memory_room().ok()
    }
}
