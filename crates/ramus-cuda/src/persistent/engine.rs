//! The persistent training engine (VPPS): one generated kernel runs a whole
//! batch — forward, head, backward and the optimizer update — with the
//! model's weight matrices (and their gradients) in registers.
//!
//! Set-up: the model's plans and fused cases ([`PersistentProgram`]), a
//! register plan for its weight matrices, the kernel (compiled through the
//! kernel cache, checked for spills and residency), and the parameters with
//! their optimizer moments uploaded once into the pool, where they stay.
//!
//! Per batch: schedule the graphs (levels), lower them to a task DAG
//! ([`unroll_batch`]), level, balance and encode it into per-processor
//! scripts ([`Scheduler`]), copy the host-provided words and the scripts to
//! the device in one copy, zero the accumulation region, launch once and
//! read back the loss.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use ramus_core::vpps::kernel::UpdateRule;
use ramus_core::vpps::{plan, DeviceLimits, PlanRequest, RegisterPlan, Scheduler};
use ramus_core::{Model, Params, Tensor};
use ramus_graph::{BatchingPolicy, InputGraph};
use ramus_nn::{OptimizerConfig, OptimizerKind};

use super::program::PersistentProgram;
use super::unroll::unroll_batch;
use super::{MatrixSlots, PersistentKernel, UpdateScalars};
use crate::cache::KernelCache;
use crate::device::CudaDevice;
use crate::error::{CudaError, Result};
use crate::pinned::PinnedBuffer;
use crate::pool::{DevicePool, DeviceView, PoolBuffer, PoolConfig};

/// How to set up a [`PersistentEngine`].
#[derive(Clone, Debug, Default)]
pub struct PersistentOptions {
    /// Device ordinal.
    pub device: usize,
    /// Rows per warp of the register partitions (default 1).
    pub rpw: Option<usize>,
    /// CTAs per SM (default: chosen from the weights' size).
    pub ctas_per_sm: Option<usize>,
    /// Kernel cache directory (default: the user cache).
    pub cache_dir: Option<PathBuf>,
}

/// What one training batch did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PersistentStep {
    /// Mean loss over the batch's head rows (NaN until the batch is back).
    pub loss: f64,
    /// Host seconds to schedule, lower and encode the batch.
    pub host_seconds: f64,
    /// Instructions of tasks (before merging) and barrier levels.
    pub tasks: usize,
    pub levels: usize,
}

/// The persistent training engine on one device; see the module docs.
pub struct PersistentEngine {
    device: Arc<CudaDevice>,
    _cache: KernelCache,
    pool: Arc<DevicePool>,
    prog: PersistentProgram,
    kernel: PersistentKernel,
    scheduler: Scheduler,
    optimizer: OptimizerConfig,
    steps: u64,
    buffer: PoolBuffer<f32>,
    barriers: PoolBuffer<u32>,
    /// Host staging for batch uploads, double-buffered: the host fills one
    /// while the other's copy (and the kernel behind it) may still run.
    staging: [PinnedBuffer; 2],
    /// Where each slot's loss is copied back.
    losses: [PinnedBuffer; 2],
    /// The slot the next batch uses.
    slot: usize,
    /// A submitted batch whose loss has not been read: its slot and step.
    pending: Option<(usize, PersistentStep)>,
    rng: ChaCha8Rng,
    fingerprint: Vec<usize>,
    setup_seconds: f64,
}

fn model_err(message: impl Into<String>) -> CudaError {
    CudaError::Model(message.into())
}

fn rule_of(kind: OptimizerKind) -> UpdateRule {
    match kind {
        OptimizerKind::Sgd => UpdateRule::Sgd,
        OptimizerKind::Adagrad => UpdateRule::Adagrad,
        OptimizerKind::Adam => UpdateRule::Adam,
    }
}

impl PersistentEngine {
    /// Sets the engine up for `model` with initial `params` and `optimizer`.
    pub fn new(
        model: &Model,
        params: &Params<f32>,
        optimizer: OptimizerConfig,
        options: &PersistentOptions,
    ) -> Result<Self> {
        let started = Instant::now();
        if optimizer.clip_norm.is_some() {
            return Err(model_err(
                "the persistent engine does not clip gradients yet; train without --clip-norm",
            ));
        }
        let device = CudaDevice::open(options.device)?;
        let cache = KernelCache::for_device(
            &device,
            options
                .cache_dir
                .clone()
                .or_else(crate::cache::default_cache_dir),
        )?;
        let prog = PersistentProgram::build(model)?;
        let limits = DeviceLimits::hopper(device.sm_count() as usize);
        let request = PlanRequest {
            rpw: options.rpw.unwrap_or(1),
            ctas_per_sm: options.ctas_per_sm,
            grads_in_registers: Some(true),
        };
        let register_plan: RegisterPlan = plan(&prog.matrices, &limits, &request)?;
        let slots: Vec<MatrixSlots> = prog
            .matrices
            .iter()
            .map(|m| MatrixSlots {
                value: prog.params.value[m.param],
                first_moment: prog.params.first[m.param],
                second_moment: prog.params.second[m.param],
            })
            .collect();
        let pool = DevicePool::new(&device, PoolConfig::default());
        let mut scheduler = Scheduler::new(&register_plan);
        scheduler.record = false;
        let kernel = PersistentKernel::build(
            &device,
            &cache,
            &pool,
            register_plan,
            rule_of(optimizer.kind),
            &prog.fused_source,
            &slots,
        )?;
        if params.values.len() != model.params.len() {
            return Err(model_err(format!(
                "{} parameter tensors for a model of {}",
                params.values.len(),
                model.params.len()
            )));
        }
        // parameters, zero gradients and moments, then room for batches
        let capacity = prog.params.total + (16 << 20);
        let buffer = pool.alloc::<f32>(capacity)?;
        let mut staging = [PinnedBuffer::new(&device)?, PinnedBuffer::new(&device)?];
        {
            let host = staging[0].host_mut::<f32>(prog.params.total)?;
            host.iter_mut().for_each(|x| *x = 0.0);
            for (p, t) in params.values.iter().enumerate() {
                let at = prog.params.value[p];
                host[at..at + t.data().len()].copy_from_slice(t.data());
            }
        }
        staging[0].upload(buffer.view().slice(0..prog.params.total)?, device.stream())?;
        let barriers = pool.alloc::<u32>(1024)?;
        staging[0].wait()?;
        let losses = [PinnedBuffer::new(&device)?, PinnedBuffer::new(&device)?];
        Ok(PersistentEngine {
            device,
            _cache: cache,
            pool,
            prog,
            kernel,
            scheduler,
            optimizer,
            steps: 0,
            buffer,
            barriers,
            staging,
            losses,
            slot: 0,
            pending: None,
            rng: ChaCha8Rng::seed_from_u64(0),
            fingerprint: crate::program::fingerprint(model),
            setup_seconds: started.elapsed().as_secs_f64(),
        })
    }

    /// Seconds [`new`](Self::new) took (kernel from the cache or compiled).
    pub fn setup_seconds(&self) -> f64 {
        self.setup_seconds
    }

    /// The register plan the kernel was generated for.
    pub fn register_plan(&self) -> &RegisterPlan {
        self.kernel.plan()
    }

    /// Registers per thread and residency of the compiled kernel.
    pub fn kernel_report(&self) -> &super::KernelReport {
        self.kernel.report()
    }

    /// Restarts the dropout masks' random stream (as the other engines'
    /// `seed`).
    pub fn seed(&mut self, seed: u64) {
        self.rng = ChaCha8Rng::seed_from_u64(seed);
    }

    /// Trains on one batch: forward, backward and the optimizer step in one
    /// kernel launch. Returns once this batch's loss is back (see
    /// [`submit`](Self::submit) for the overlapped form).
    pub fn train_batch(&mut self, model: &Model, graphs: &[&InputGraph]) -> Result<PersistentStep> {
        self.submit(model, graphs)?;
        self.latest()?
            .ok_or_else(|| model_err("the submitted batch has no loss"))
    }

    /// VPPS' training call: prepares and enqueues one batch (forward,
    /// backward and update in one launch) and returns the *previous*
    /// batch's step, if one was pending — so the host prepares batch `t +
    /// 1` while the device runs batch `t`. [`latest`](Self::latest) waits
    /// for the last one.
    pub fn submit(
        &mut self,
        model: &Model,
        graphs: &[&InputGraph],
    ) -> Result<Option<PersistentStep>> {
        if crate::program::fingerprint(model) != self.fingerprint {
            return Err(model_err(
                "the batch is for a different model than the engine was set up for",
            ));
        }
        if graphs.is_empty() {
            return Err(model_err("an empty batch"));
        }
        let started = Instant::now();
        let schedule = ramus_cpu::Batch::new(model, graphs.to_vec(), BatchingPolicy::Cavs)
            .map_err(|e| model_err(format!("scheduling the batch: {e}")))?
            .schedule;
        let batch = unroll_batch(model, &self.prog, &schedule, &mut self.rng)?;
        let scripts = self.scheduler.schedule(&batch.graph)?;
        let packed = &scripts.packed;
        let host_seconds = started.elapsed().as_secs_f64();

        // the pool: parameters, the batch's regions, then the scripts
        let script_at = batch.end;
        let needed = script_at + packed.words.len();
        self.ensure_capacity(needed)?;
        if self.barriers.len() < packed.barriers.max(1) {
            self.barriers = self
                .pool
                .alloc::<u32>(packed.barriers.next_power_of_two())?;
        }
        let stream = self.device.stream().clone();
        let view = self.buffer.view();
        let slot = self.slot;
        self.slot ^= 1;
        {
            // waits for this slot's previous upload to have been copied
            let upload_len = needed - batch.upload_at;
            let host = self.staging[slot].host_mut::<f32>(upload_len)?;
            for (d, &w) in host
                .iter_mut()
                .zip(batch.upload.iter().chain(&packed.words))
            {
                *d = f32::from_bits(w);
            }
        }
        self.staging[slot].upload(view.slice(batch.upload_at..needed)?, &stream)?;
        view.slice(batch.zeroed.clone())?.fill_zero(&stream)?;
        self.steps += 1;
        let c = &self.optimizer;
        let t = self.steps as f64;
        let scalars = UpdateScalars {
            lr: c.lr as f32,
            weight_decay: c.weight_decay as f32,
            beta1: c.beta1 as f32,
            beta2: c.beta2 as f32,
            eps: c.eps as f32,
            inv_bias_correction1: (1.0 / (1.0 - c.beta1.powf(t))) as f32,
            inv_bias_correction2: (1.0 / (1.0 - c.beta2.powf(t))) as f32,
            clip: 1.0,
        };
        let script: DeviceView<u32> = view.slice(script_at..needed)?.reinterpret();
        self.kernel
            .launch(view, script, packed, self.barriers.view(), &scalars)?;
        self.losses[slot].download(view.slice(batch.loss_at..batch.loss_at + 1)?, &stream)?;
        let step = PersistentStep {
            loss: f64::NAN,
            host_seconds,
            tasks: batch.graph.len(),
            levels: scripts.levels,
        };
        let previous = self.pending.replace((slot, step));
        previous
            .map(|(s, step)| self.read_loss(s, step))
            .transpose()
    }

    /// Waits for the last submitted batch and returns its step (its loss
    /// included); `None` if every submitted batch was already returned.
    pub fn latest(&mut self) -> Result<Option<PersistentStep>> {
        match self.pending.take() {
            Some((slot, step)) => self.read_loss(slot, step).map(Some),
            None => Ok(None),
        }
    }

    /// `step` with the loss its slot's copy brought back (waits for it).
    fn read_loss(&self, slot: usize, step: PersistentStep) -> Result<PersistentStep> {
        let loss = self.losses[slot].host::<f32>(1)?;
        Ok(PersistentStep {
            loss: f64::from(loss[0]),
            ..step
        })
    }

    /// Grows the pool buffer to `floats`, keeping the parameter region.
    fn ensure_capacity(&mut self, floats: usize) -> Result<()> {
        if floats <= self.buffer.len() {
            return Ok(());
        }
        let stream = self.device.stream().clone();
        let total = self.prog.params.total;
        let kept = self.staging[self.slot]
            .download_to_vec(self.buffer.view().slice(0..total)?, &stream)?;
        let bigger = self.pool.alloc::<f32>(floats.next_power_of_two())?;
        self.staging[self.slot].upload_slice(&kept, bigger.view().slice(0..total)?, &stream)?;
        self.staging[self.slot].wait()?;
        self.buffer = bigger;
        Ok(())
    }

    /// The current parameter values (downloaded).
    pub fn params(&mut self, model: &Model) -> Result<Params<f32>> {
        let stream = self.device.stream().clone();
        let total = self.prog.params.total;
        let all = self.staging[self.slot]
            .download_to_vec(self.buffer.view().slice(0..total)?, &stream)?;
        let values = model
            .params
            .iter()
            .enumerate()
            .map(|(p, spec)| {
                let at = self.prog.params.value[p];
                Tensor::from_vec(&spec.shape, all[at..at + self.prog.params.len[p]].to_vec())
                    .map_err(|e| model_err(format!("parameter `{}`: {e}", spec.name)))
            })
            .collect::<Result<Vec<_>>>()?;
        Params::from_tensors(model, values).map_err(|e| model_err(format!("parameters: {e}")))
    }
}
