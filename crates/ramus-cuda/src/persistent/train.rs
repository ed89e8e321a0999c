//! The persistent engine behind the [`Engine`] trait, so the trainer (and
//! `ramus train --engine persistent`) drives it: training steps go through
//! the overlapped VPPS call (each returns the previous batch's loss), and
//! evaluation runs on the batched CUDA engine with the parameters brought
//! back from the device.
//!
//! Non-finite steps: the update runs inside the training kernel, so a step
//! cannot be held back ([`Engine::skips_nonfinite`] is false: the trainer
//! refuses `skip-batch` up front). A batch whose loss comes back non-finite,
//! or whose update met a non-finite gradient or value (the kernel's fault
//! word, copied back with the loss), is reported with the first parameter
//! whose value is not finite (read back then).

use ramus_core::{Grads, Model, Params};
use ramus_exec::nonfinite::first_nonfinite;
use ramus_exec::{Batch, ForwardOutput, Mode};
use ramus_exec::{Engine, ExecError, NonFiniteStep, Optimizer, OptimizerConfig, StepOutcome};
use rand_chacha::ChaCha8Rng;

use super::{PersistentEngine, PersistentOptions};
use crate::engine::{CudaEngine, CudaEngineOptions};
use crate::error::Result;
use crate::memory::{block_bytes, model_fits, DeviceCheck};
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

/// Training on the persistent engine, evaluation on the batched one.
pub struct PersistentTrainer {
    engine: PersistentEngine,
    eval: CudaEngine,
    /// The model the engines were set up for (to rebuild parameters).
    model: Model,
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

    fn outcomes(
        &mut self,
        steps: Vec<super::PersistentStep>,
    ) -> ramus_exec::Result<Vec<StepOutcome>> {
        steps.iter().map(|s| self.outcome(s)).collect()
    }
}

impl Engine<f32> for PersistentTrainer {
    fn name(&self) -> &'static str {
        "cuda-persistent"
    }

    fn forward_rows(
        &mut self,
        model: &Model,
        params: &Params<f32>,
        batch: &Batch<'_>,
        mode: Mode,
        rows: ramus_core::HeadRows,
    ) -> ramus_exec::Result<ForwardOutput<f32>> {
        self.eval.forward_rows(model, params, batch, mode, rows)
    }

    fn backward(
        &mut self,
        model: &Model,
        params: &Params<f32>,
        batch: &Batch<'_>,
        grads: &mut Grads<f32>,
    ) -> ramus_exec::Result<()> {
        self.eval.backward(model, params, batch, grads)
    }

    fn set_seed(&mut self, seed: u64) {
        self.engine.seed(seed);
        Engine::<f32>::set_seed(&mut self.eval, seed);
    }

    fn dropout_rng(&self) -> ChaCha8Rng {
        self.engine.dropout_rng().clone()
    }

    fn set_dropout_rng(&mut self, rng: ChaCha8Rng) {
        self.engine.set_dropout_rng(rng.clone());
        Engine::<f32>::set_dropout_rng(&mut self.eval, rng);
    }

    fn sync_host_optimizer(&mut self, optimizer: &mut Optimizer<f32>) -> ramus_exec::Result<()> {
        self.engine.download_optimizer(optimizer).map_err(exec_err)
    }

    fn load_optimizer_state(&mut self, optimizer: &Optimizer<f32>) -> ramus_exec::Result<()> {
        self.engine.upload_optimizer(optimizer).map_err(exec_err)
    }

    fn device_memory_room(&self) -> Option<u64> {
        self.eval.memory_room().ok()
    }

    fn sync_host_params(&mut self, params: &mut Params<f32>) -> ramus_exec::Result<()> {
        // the batches still in flight update the parameters first
        self.engine.latest().map_err(exec_err)?;
        *params = self.engine.params(&self.model).map_err(exec_err)?;
        Ok(())
    }

    fn train_step(
        &mut self,
        model: &Model,
        params: &mut Params<f32>,
        grads: &mut Grads<f32>,
        optimizer: &mut Optimizer<f32>,
        batch: &Batch<'_>,
    ) -> ramus_exec::Result<f64> {
        // a step still in flight is from an earlier call: its loss is dropped
        self.submit_train_step(model, params, grads, optimizer, batch)?;
        let step = self
            .engine
            .latest()
            .map_err(exec_err)?
            .ok_or_else(|| ExecError::Config("the persistent step returned no loss".into()))?;
        self.outcome(&step)?.map_err(Into::into)
    }

    fn skips_nonfinite(&self) -> bool {
        false
    }

    fn submit_train_step(
        &mut self,
        model: &Model,
        _params: &mut Params<f32>,
        _grads: &mut Grads<f32>,
        _optimizer: &mut Optimizer<f32>,
        batch: &Batch<'_>,
    ) -> ramus_exec::Result<Option<StepOutcome>> {
        let previous = self
            .engine
            .submit_scheduled(model, &batch.schedule, std::time::Instant::now())
            .map_err(exec_err)?;
        previous.map(|s| self.outcome(&s)).transpose()
    }

    fn lookahead(&self) -> usize {
        prepared_ahead()
    }

    fn submit_train_steps(
        &mut self,
        model: &Model,
        _params: &mut Params<f32>,
        _grads: &mut Grads<f32>,
        _optimizer: &mut Optimizer<f32>,
        batches: &[Batch<'_>],
    ) -> ramus_exec::Result<Vec<StepOutcome>> {
        let schedules: Vec<&ramus_graph::Schedule> = batches.iter().map(|b| &b.schedule).collect();
        let steps = self
            .engine
            .submit_many_scheduled(model, &schedules, std::time::Instant::now())
            .map_err(exec_err)?;
        self.outcomes(steps)
    }

    fn finish_train_steps(&mut self) -> ramus_exec::Result<Vec<StepOutcome>> {
        let steps = self.engine.finish().map_err(exec_err)?;
        self.outcomes(steps)
    }
}
