//! Training on the device: the fused optimizer over the engine's
//! parameter buffers, a step's forward, backward and update without the
//! host, the parameters brought back on demand; and the engine as a
//! training engine, [`CudaTrainer`] ([`ramus_exec::TrainEngine`]).

use ramus_core::{Grads, HeadRows, Model, Params};
use ramus_exec::{steps_in_flight, Batch, ForwardOutput, Mode, TrainEngine, TrainState};
use ramus_exec::{Optimizer, OptimizerConfig, StepOutcome};
use ramus_graph::Schedule;

use crate::error::{CudaError, Result};
use crate::optimizer::{DeviceOptimizer, GradLayout, ParamSlot};
use crate::pool::DeviceView;

use super::{model_err, CudaEngine, StepLoss};

impl CudaEngine {
    /// Per row-gradient table, in parameter order: the rows this batch
    /// touches (the distinct tokens of the rows of every function whose
    /// backward graph adds rows into the table, as the CPU engine marks
    /// them), uploaded as one sorted device list per table.
    pub(crate) fn touched_rows(
        &mut self,
        model: &Model,
        s: &Schedule,
    ) -> Result<Vec<(usize, DeviceView<u32>)>> {
        let lists = self.touched_row_lists(model, s);
        self.upload_row_lists(&lists)
    }

    /// [`touched_rows`](Self::touched_rows) on the host: sorted, unique.
    pub(crate) fn touched_row_lists(&self, model: &Model, s: &Schedule) -> Vec<(usize, Vec<u32>)> {
        crate::batch::touched_rows(model, s, &self.program.row_grad_params)
    }

    /// Row lists uploaded, one device list per table.
    pub(crate) fn upload_row_lists(
        &mut self,
        lists: &[(usize, Vec<u32>)],
    ) -> Result<Vec<(usize, DeviceView<u32>)>> {
        let mut out = Vec::with_capacity(lists.len());
        for (p, rows) in lists {
            out.push((
                *p,
                self.upload_indices_of(rows, &|| "touched row ids".into())?,
            ));
        }
        Ok(out)
    }

    /// The optimizer on the device for the current parameter buffers,
    /// (re)built when missing, when the buffers moved, or when the
    /// optimizer kind or clipping changed.
    pub(crate) fn device_optimizer(
        &mut self,
        model: &Model,
        config: &OptimizerConfig,
    ) -> Result<&mut DeviceOptimizer> {
        let generation = self.param_views()?.generation;
        let reusable = match &mut self.optimizer {
            Some((built_for, opt)) if *built_for == generation => opt.set_config(config).is_ok(),
            _ => false,
        };
        if !reusable {
            let dp = self.param_views()?;
            let slots: Vec<ParamSlot> = (0..dp.values.len())
                .map(|p| ParamSlot {
                    value: dp.values[p],
                    grad: dp.grads[p],
                    layout: if model.is_buffer(p) {
                        GradLayout::Frozen
                    } else if self.program.row_grad_params.contains(&p) {
                        GradLayout::Rows {
                            width: model.params[p].shape.get(1).copied().unwrap_or(1),
                        }
                    } else {
                        GradLayout::Dense
                    },
                })
                .collect();
            let mut opt =
                DeviceOptimizer::new(&self.device, &self.pool, &self.cache, config, &slots)?;
            opt.set_lr_scales(&self.lr_scales)?;
            if let Some(host) = self.pending_optimizer.take() {
                opt.upload_from(self.device.stream(), &host)?;
            }
            self.optimizer = Some((generation, opt));
        }
        match &mut self.optimizer {
            Some((_, opt)) => Ok(opt),
            None => Err(model_err("device optimizer missing")),
        }
    }

    /// Makes parameter `p`'s update take the learning rate times
    /// `scales[p]` (0: frozen; empty: 1 for every one), from the next step
    /// on; the fused optimizer keeps its state.
    pub fn set_lr_scales(&mut self, scales: &[f64]) -> Result<()> {
        if let Some((_, opt)) = &mut self.optimizer {
            opt.set_lr_scales(scales)?;
        }
        self.lr_scales = scales.to_vec();
        Ok(())
    }

    /// Forward, backward and the fused optimizer update (held back if the
    /// loss or a gradient is not finite), all on the device; the host
    /// parameters lag until [`CudaEngine::download_params`]. Returns the
    /// outcome of the step before, which the loss's download has brought
    /// back (see [`CudaEngine::settle_step`]); this step's stays pending.
    pub(super) fn device_train_step(
        &mut self,
        model: &Model,
        params: &mut Params<f32>,
        config: &OptimizerConfig,
        batch: &Batch<'_>,
    ) -> Result<Option<StepOutcome>> {
        self.check_model(model)?;
        self.sync_params(model, params)?;
        let stream = self.device.stream().clone();
        self.keep_buffers(model, config)?;
        let (loss, _) = self.train_forward(model, params, batch)?;
        let previous = self.settle_step()?;
        let loss_view = self.loss_view(model)?;
        // staged before the backward pass: behind it, the copy would hold
        // up the next step's first upload until this step is done
        let touched: Vec<DeviceView<u32>> = self
            .touched_rows(model, &batch.schedule)?
            .into_iter()
            .map(|(_, v)| v)
            .collect();
        self.backward_on_device(model, params, batch, None)?;
        let report = self
            .device_optimizer(model, config)?
            .step(&stream, &touched, loss_view, false)?;
        for _ in 0..report.launches {
            self.launcher.count();
        }
        self.step_submitted(params, StepLoss::Host(loss));
        Ok(previous)
    }

    /// A training step's forward pass (its running statistics kept for the
    /// update): the loss and the head rows.
    pub(crate) fn train_forward(
        &mut self,
        model: &Model,
        params: &Params<f32>,
        batch: &Batch<'_>,
    ) -> Result<(f64, usize)> {
        self.track_running_stats = true;
        let out = self.forward_pass(model, params, batch, Mode::Train, model.head.rows);
        self.track_running_stats = false;
        let out = out?;
        let loss = out
            .loss
            .ok_or_else(|| model_err("forward pass returned no loss"))?;
        Ok((loss, out.head_vertices.len()))
    }

    /// Before a training step's forward pass: keeps a copy of the buffers
    /// (batch normalisation's running statistics, which the pass blends)
    /// for the optimizer to put back if the step is skipped.
    pub(crate) fn keep_buffers(&mut self, model: &Model, config: &OptimizerConfig) -> Result<()> {
        let stream = self.device.stream().clone();
        let kept = self
            .device_optimizer(model, config)?
            .keep_buffers(&stream)?;
        (0..kept).for_each(|_| self.launcher.count());
        Ok(())
    }

    /// After a training step is enqueued: its loss waits for its status
    /// ([`CudaEngine::settle_step`]), and the device parameters are ahead
    /// of `params` until [`CudaEngine::download_params`].
    pub(crate) fn step_submitted(&mut self, params: &mut Params<f32>, loss: StepLoss) {
        self.pending_loss = Some(loss);
        params.touch();
        if let Some(dp) = self.params.as_mut() {
            dp.version = params.version();
            dp.host_stale = true;
        }
    }

    /// Copies the device parameters into `params` if a device step changed them.
    pub fn download_params(&mut self, params: &mut Params<f32>) -> Result<()> {
        let stream = self.device.stream().clone();
        let Some(dp) = self.params.as_ref() else {
            return Ok(());
        };
        if !dp.host_stale || dp.version != params.version() {
            return Ok(());
        }
        let all = dp._values.view();
        let total: usize = params.values.iter().map(|t| t.data().len()).sum();
        let host = self
            .staging
            .download_to_vec(all.slice(0..total)?, &stream)?;
        let mut at = 0;
        for t in params.values.iter_mut() {
            let len = t.data().len();
            t.data_mut().copy_from_slice(&host[at..at + len]);
            at += len;
        }
        params.touch();
        if let Some(dp) = self.params.as_mut() {
            dp.version = params.version();
            dp.host_stale = false;
        }
        Ok(())
    }
}

/// The batched engine's own passes, taking the model and parameters on
/// each call as the CPU reference engine's do: what tests compare against
/// it. Training goes through [`CudaTrainer`].
impl CudaEngine {
    /// Forward pass over `batch` with the head on the model's own rows.
    pub fn forward(
        &mut self,
        model: &Model,
        params: &Params<f32>,
        batch: &Batch<'_>,
        mode: Mode,
    ) -> Result<ForwardOutput<f32>> {
        self.forward_pass(model, params, batch, mode, model.head.rows)
    }

    /// Forward pass with the head on `rows`.
    pub fn forward_rows(
        &mut self,
        model: &Model,
        params: &Params<f32>,
        batch: &Batch<'_>,
        mode: Mode,
        rows: HeadRows,
    ) -> Result<ForwardOutput<f32>> {
        self.forward_pass(model, params, batch, mode, rows)
    }

    /// Backward pass of the last train-mode forward pass; adds parameter
    /// gradients into `grads` (on the host).
    pub fn backward(
        &mut self,
        model: &Model,
        params: &Params<f32>,
        batch: &Batch<'_>,
        grads: &mut Grads<f32>,
    ) -> Result<()> {
        self.backward_pass(model, params, batch, grads)
    }

    /// Continues the dropout masks from `rng`.
    pub fn set_dropout_rng(&mut self, rng: rand_chacha::ChaCha8Rng) {
        self.rng = rng;
    }
}

/// Gradient accumulation's buffer, kept across steps: the scaled
/// gradients of a step's batches so far, then their scaled loss (one
/// float past the gradients).
pub(crate) struct Accumulator {
    pub(super) buf: crate::pool::PoolBuffer<f32>,
    /// Whether the buffer holds a sum (a step's earlier batch added to it).
    pub(super) holding: bool,
}

/// Whether a step's earlier batch has added to `acc` (a batch now is not
/// its step's first).
pub(crate) fn mid_step(acc: &Option<Accumulator>) -> bool {
    acc.as_ref().is_some_and(|a| a.holding)
}

/// The CUDA batched engine as a training engine for one model: the
/// parameters and the optimizer's moments and step count live on the
/// device and are updated there; [`TrainEngine::state`] reads them back.
pub struct CudaTrainer {
    pub(crate) engine: CudaEngine,
    pub(crate) model: Model,
    /// The parameters the device copy was made from. The engine uploads
    /// them when their version changes; a training step leaves the device
    /// copy ahead and gives these values the device copy's version, so
    /// they are never uploaded over it (their values lag until
    /// [`TrainEngine::state`] brings them back).
    pub(crate) uploaded: Params<f32>,
    pub(crate) config: OptimizerConfig,
    /// The scaled gradients and loss of a step's batches so far (gradient
    /// accumulation, `engine/split.rs`).
    pub(crate) accumulated: Option<Accumulator>,
}

impl CudaTrainer {
    /// Trains `model` from `params` on `engine` (set up for `model`) with
    /// a fresh optimizer of `config`.
    pub fn new(
        engine: CudaEngine,
        model: Model,
        params: Params<f32>,
        config: OptimizerConfig,
    ) -> Result<Self> {
        engine.check_model(&model)?;
        Ok(CudaTrainer {
            engine,
            model,
            uploaded: params,
            config,
            accumulated: None,
        })
    }

    /// The engine underneath (its counters and reports).
    pub fn engine(&self) -> &CudaEngine {
        &self.engine
    }

    /// Makes the training passes of this data-parallel rank normalise
    /// batches with the statistics of every rank's rows, summed through
    /// `collective`, another handle on the rank's group
    /// ([`Collective::handle`](ramus_exec::data_parallel::Collective::handle)).
    pub fn sync_batch_norm(
        &mut self,
        collective: Box<dyn ramus_exec::data_parallel::Collective<f32>>,
    ) -> Result<()> {
        self.engine.sync_batch_norm(&self.model, collective)
    }

    /// The device the engine runs on (an NCCL communicator joins on its
    /// stream).
    pub fn device(&self) -> &std::sync::Arc<crate::CudaDevice> {
        &self.engine.device
    }

    pub(crate) fn check_idle(&self, call: &str) -> ramus_exec::Result<()> {
        match self.engine.pending_loss {
            Some(_) => Err(steps_in_flight("cuda-batched", call)),
            None => Ok(()),
        }
    }
}

impl TrainEngine<f32> for CudaTrainer {
    fn name(&self) -> &'static str {
        "cuda-batched"
    }
    fn model(&self) -> &Model {
        &self.model
    }
    fn forward_rows(
        &mut self,
        batch: &Batch<'_>,
        mode: Mode,
        rows: HeadRows,
    ) -> ramus_exec::Result<ForwardOutput<f32>> {
        self.check_idle("a forward pass")?;
        let (model, params) = (&self.model, &self.uploaded);
        Ok(self.engine.forward_pass(model, params, batch, mode, rows)?)
    }
    /// Forward, backward and the fused optimizer update of each batch on
    /// the device; each step's outcome comes back with the next step's
    /// loss (or [`finish`](TrainEngine::finish)).
    fn submit(&mut self, batches: &[Batch<'_>]) -> ramus_exec::Result<Vec<StepOutcome>> {
        let mut outcomes = Vec::new();
        for batch in batches {
            let (model, params) = (&self.model, &mut self.uploaded);
            outcomes.extend(
                self.engine
                    .device_train_step(model, params, &self.config, batch)?,
            );
        }
        Ok(outcomes)
    }
    fn finish(&mut self) -> ramus_exec::Result<Vec<StepOutcome>> {
        Ok(self.engine.settle_step()?.into_iter().collect())
    }
    fn set_seed(&mut self, seed: u64) {
        self.engine.set_seed(seed)
    }
    /// The fused optimizer takes the configuration at every step (its
    /// rate is a kernel argument, so no recompiling).
    fn set_lr(&mut self, lr: f64) -> ramus_exec::Result<()> {
        self.config.set_lr(lr)
    }
    fn set_lr_scales(&mut self, scales: &[f64]) -> ramus_exec::Result<()> {
        ramus_exec::optim::check_lr_scales(scales, self.model.params.len())?;
        Ok(self.engine.set_lr_scales(scales)?)
    }
    fn state(&mut self) -> ramus_exec::Result<TrainState<f32>> {
        self.check_idle("state()")?;
        self.engine.download_params(&mut self.uploaded)?;
        // before the first step the optimizer state is the restored one
        let mut optimizer = match &self.engine.pending_optimizer {
            Some(restored) => restored.clone(),
            None => Optimizer::new(self.config, &self.uploaded),
        };
        self.engine.download_optimizer(&mut optimizer)?;
        Ok(TrainState {
            params: self.uploaded.clone(),
            optimizer,
            dropout: self.engine.rng.clone(),
        })
    }
    fn restore(&mut self, state: TrainState<f32>) -> ramus_exec::Result<()> {
        self.check_idle("restore()")?;
        state.check_fits(&self.model, &self.config)?;
        self.engine.upload_optimizer(&state.optimizer)?;
        self.config = state.optimizer.config;
        // new values, a new version: uploaded before the next pass
        self.uploaded = state.params;
        self.engine.set_dropout_rng(state.dropout);
        Ok(())
    }
    fn device_memory_room(&self) -> Option<u64> {
        self.engine.memory_room().ok()
    }
    /// A data-parallel rank's gradient sums, per step: from the first
    /// bucket's sum to the loss's, and what the update waited for after
    /// the backward pass (the sums it did not hide).
    fn timing_report(&mut self) -> Option<String> {
        let t = match self.engine.take_sum_times() {
            Ok(t) => t,
            Err(e) => return Some(format!("gradient sums not timed: {e}")),
        };
        let per_step = |ms: f64| ms / t.steps as f64;
        (t.steps > 0).then(|| {
            format!(
                "gradient sums {:.2} ms a step from the first bucket to the loss, {:.2} ms after \
                 the backward pass",
                per_step(t.span_ms),
                per_step(t.exposed_ms)
            )
        })
    }
}

impl From<CudaError> for ramus_exec::ExecError {
    fn from(e: CudaError) -> Self {
        ramus_exec::ExecError::Device(e.to_string())
    }
}
