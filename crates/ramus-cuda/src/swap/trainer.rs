//! [`SwapTrainer`]: the CUDA batched engine wrapped for training past
//! device memory. The engine underneath knows nothing of swapping; the
//! wrapper runs each step (and each forward pass the swap path can take)
//! op by op on the engine's kernels, under the [`ramus_swap::Executor`].

use ramus_core::{HeadRows, Model, Params};
use ramus_exec::data_parallel::{Collective, SplitStep, StepPlan};
use ramus_exec::{Batch, ForwardOutput, Mode, TrainEngine, TrainState};
use ramus_exec::{OptimizerConfig, StepOutcome};
use ramus_swap::{SwapPlan, Trace};

use super::runtime::SwapRuntime;
use super::runtime::Update::{Fused, Split};
use super::steps::{check_dynamic, check_static};
use super::{SwapConfig, SwapMode, SwapStepReport};
use crate::engine::{mid_step, CudaEngine, CudaEngineOptions, CudaTrainer, SplitUpdate};
use crate::error::Result;

/// The swap path as a training engine: a [`CudaTrainer`] whose steps (and
/// evaluation and inference passes, for the models the swap path takes)
/// run op by op, each tensor allocated before its first use and freed or
/// offloaded to pinned host memory after its last, as [`SwapConfig`]
/// says (see [`crate::swap`]). Parameters, gradients and optimizer state
/// stay resident in the engine's pool. With [`SwapMode::Off`] every call
/// goes to the plain trainer, so that one type runs every mode.
pub struct SwapTrainer {
    inner: CudaTrainer,
    /// The swap path's state; `None` with [`SwapMode::Off`].
    rt: Option<SwapRuntime>,
}

impl SwapTrainer {
    /// Sets up the CUDA engine for `model` as `options` say and trains it
    /// from `params` with a fresh optimizer of `config`, swapping as
    /// `swap` says. Under a budget (`options.pool.max_bytes`) the pool is
    /// one chunk of exactly the budget, so nothing outside it is reserved.
    pub fn new(
        model: Model,
        options: &CudaEngineOptions,
        swap: SwapConfig,
        params: Params<f32>,
        config: OptimizerConfig,
    ) -> Result<Self> {
        if swap.mode == SwapMode::Off {
            let engine = CudaEngine::new(&model, options)?;
            let inner = CudaTrainer::new(engine, model, params, config)?;
            return Ok(SwapTrainer { inner, rt: None });
        }
        let mut options = options.clone();
        if let Some(budget) = options.pool.max_bytes {
            // tensors come and go inside the one chunk
            options.pool.initial_bytes = budget;
        }
        // the batch arena holds only index arrays: tensors have their own memory
        let engine = CudaEngine::with_arena(&model, &options, 1 << 20)?;
        let rt = SwapRuntime::new(engine.device(), swap)?;
        let inner = CudaTrainer::new(engine, model, params, config)?;
        Ok(SwapTrainer {
            inner,
            rt: Some(rt),
        })
    }

    /// The engine underneath (its device, counters and reports).
    pub fn engine(&self) -> &CudaEngine {
        self.inner.engine()
    }

    /// Synchronized batch normalisation, as
    /// [`CudaTrainer::sync_batch_norm`].
    pub fn sync_batch_norm(&mut self, collective: Box<dyn Collective<f32>>) -> Result<()> {
        self.inner.sync_batch_norm(collective)
    }

    /// What the last training step did (`None` with [`SwapMode::Off`] or
    /// before the first step).
    pub fn last_report(&self) -> Option<&SwapStepReport> {
        self.rt.as_ref().and_then(SwapRuntime::last_report)
    }

    /// The swap settings (`None` with [`SwapMode::Off`]).
    pub fn config(&self) -> Option<&SwapConfig> {
        self.rt.as_ref().map(SwapRuntime::config)
    }

    /// The trace and plan of the training iteration on `batch`, once a
    /// step of its shape has run (a profiled plan appears after the first
    /// step of the shape).
    pub fn plan(&self, batch: &Batch<'_>) -> Option<(Trace, Option<SwapPlan>)> {
        let inner = &self.inner;
        self.rt
            .as_ref()?
            .plan_of(&inner.engine, &inner.model, batch)
    }
}

impl TrainEngine<f32> for SwapTrainer {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn model(&self) -> &Model {
        self.inner.model()
    }
    /// Forward-only passes of a model the swap path takes go op by op too
    /// (tensors freed after their last use); the rest run on the engine.
    fn forward_rows(
        &mut self,
        batch: &Batch<'_>,
        mode: Mode,
        rows: HeadRows,
    ) -> ramus_exec::Result<ForwardOutput<f32>> {
        let inner = &mut self.inner;
        let program = &inner.engine.program;
        let swappable = check_static(&inner.model, program).is_ok()
            || check_dynamic(&inner.model, program).is_ok();
        match self.rt.as_mut() {
            Some(rt) if mode != Mode::Train && swappable => {
                inner.check_idle("a forward pass")?;
                let (model, params) = (&inner.model, &inner.uploaded);
                Ok(rt.forward(&mut inner.engine, model, params, batch, mode, rows)?)
            }
            _ => inner.forward_rows(batch, mode, rows),
        }
    }
    /// Forward, backward and the fused optimizer update of each batch, op
    /// by op on the device; each step's outcome comes back with the next
    /// step's loss (or [`finish`](TrainEngine::finish)).
    fn submit(&mut self, batches: &[Batch<'_>]) -> ramus_exec::Result<Vec<StepOutcome>> {
        let Some(rt) = self.rt.as_mut() else {
            return self.inner.submit(batches);
        };
        let inner = &mut self.inner;
        let mut outcomes = Vec::new();
        for batch in batches {
            let (model, params, config) = (&inner.model, &mut inner.uploaded, &inner.config);
            let trained = (model, &mut *params);
            let (previous, _) = rt.train_step(&mut inner.engine, trained, config, batch, Fused)?;
            outcomes.extend(previous);
        }
        Ok(outcomes)
    }
    fn finish(&mut self) -> ramus_exec::Result<Vec<StepOutcome>> {
        self.inner.finish()
    }
    fn set_seed(&mut self, seed: u64) {
        self.inner.set_seed(seed)
    }
    /// The swap path's steps read the inner engine's configuration.
    fn set_lr(&mut self, lr: f64) -> ramus_exec::Result<()> {
        self.inner.set_lr(lr)
    }
    fn set_lr_scales(&mut self, scales: &[f64]) -> ramus_exec::Result<()> {
        self.inner.set_lr_scales(scales)
    }
    fn state(&mut self) -> ramus_exec::Result<TrainState<f32>> {
        self.inner.state()
    }
    fn restore(&mut self, state: TrainState<f32>) -> ramus_exec::Result<()> {
        self.inner.restore(state)
    }
    fn memory_report(&self) -> Option<String> {
        self.last_report().map(|r| r.to_string())
    }
    fn device_memory_room(&self) -> Option<u64> {
        self.inner.device_memory_room()
    }
    fn timing_report(&mut self) -> Option<String> {
        self.inner.timing_report()
    }
}

/// Data-parallel and accumulated steps on the swap path: the forward and
/// backward passes op by op, then the batched engine's update half (the
/// gradients summed over the ranks, the update over the step plan's rows).
/// A rank without a batch in a step, and [`SwapMode::Off`], take the
/// batched engine's split step.
impl SplitStep<f32> for SwapTrainer {
    fn split_step(
        &mut self,
        collective: &mut dyn Collective<f32>,
        batch: Option<&Batch<'_>>,
        plan: &StepPlan,
    ) -> ramus_exec::Result<Vec<StepOutcome>> {
        let inner = &mut self.inner;
        let (Some(rt), Some(batch)) = (self.rt.as_mut(), batch) else {
            return inner.split_step(collective, batch, plan);
        };
        let engine = &mut inner.engine;
        let (model, params, config) = (&inner.model, &mut inner.uploaded, &inner.config);
        engine.start_norm_step(true)?;
        if !plan.last {
            // fixed memory like the optimizer's state: before the step's tensors
            engine.sync_params(model, params)?;
            engine.ensure_accumulator(&mut inner.accumulated)?;
        }
        let split = Split {
            first: !mid_step(&inner.accumulated),
        };
        let (previous, rows) =
            rt.train_step(engine, (model, &mut *params), config, batch, split)?;
        engine.split_update(SplitUpdate {
            model,
            params,
            config,
            collective,
            plan,
            rows,
            accumulator: &mut inner.accumulated,
            touched: None,
            sums: None,
        })?;
        Ok(previous.into_iter().collect())
    }
}
