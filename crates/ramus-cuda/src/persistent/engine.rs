//! The persistent training engine (VPPS): one generated kernel runs a whole
//! batch — forward, head, backward and the optimizer update — with the
//! model's weight matrices (and their gradients) in registers.
//!
//! Set-up: the model's plans and fused cases ([`PersistentProgram`]), a
//! register plan for its weight matrices, the kernel (compiled through the
//! kernel cache, checked for spills and residency), and the parameters with
//! their optimizer moments uploaded once into the pool, where they stay.
//! Where the kernel must be compiled, a bridge kernel (the same source
//! compiled quickly, [`PersistentKernel::bridge`]) trains the first batches
//! while it compiles, and the device opens on another thread meanwhile.
//!
//! Per batch: schedule the graphs (levels), lower them to a task DAG
//! ([`unroll_batch`]), level, balance and encode it into per-processor
//! scripts ([`Scheduler`]), copy the scripts to the batch's own device
//! buffer on a copy stream (while the batch before still runs) and the
//! host-provided words to the pool, zero the accumulation region, launch
//! once (or, where a level's product is wide enough for cuBLAS, several
//! times with the GEMMs between the launches; see
//! [`ramus_core::vpps::launches`]) and read back the loss.
//!
//! Batches overlap: [`PersistentEngine::submit`] returns the previous
//! batch's step, so the host prepares batch `t + 1` while the device runs
//! batch `t` (VPPS §III-B); [`PersistentEngine::submit_many`] prepares a
//! window of batches on all cores at once (a batch's preparation depends on
//! its structure only, never on the weights) and queues them behind the
//! batches still running.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use cudarc::driver::{CudaEvent, CudaStream};
use ramus_core::vpps::RegisterPlan;
use ramus_core::{Model, Params, Tensor};
use ramus_exec::OptimizerConfig;

mod batch;
mod compile;
mod enqueue;
mod options;
mod prepare;
mod resume;
mod setup;
mod sizes;
mod split;
mod submit;
mod tune;
mod variant;

pub use options::{PersistentOptions, PersistentStep, HOST_PRODUCT_ITEMS};

use super::program::PersistentProgram;
use crate::blas::Blas;
use crate::cache::KernelCache;
use crate::device::CudaDevice;
use crate::error::Result;
use crate::pinned::PinnedBuffer;
use crate::pool::{DevicePool, PoolBuffer};
use options::model_err;
use variant::{Tuning, Variant, VariantBuild, VariantChoice};

/// The persistent training engine on one device; see the module docs.
pub struct PersistentEngine {
    device: Arc<CudaDevice>,
    cache: KernelCache,
    pool: Arc<DevicePool>,
    /// Shared with the threads preparing batches.
    prog: Arc<PersistentProgram>,
    /// Compiled variants (one per `rpw` tried) and the one in use.
    variants: Vec<Variant>,
    active: usize,
    /// The profile-guided `rpw` search, while it runs.
    tuning: Option<Tuning>,
    /// What building another variant needs.
    build: VariantBuild,
    /// Kernel seconds of the last batch read back.
    last_kernel_seconds: Option<f64>,
    /// cuBLAS, for the weight gradients of a plan without register
    /// gradients (made at first use).
    blas: Option<Blas>,
    optimizer: OptimizerConfig,
    /// The learning rates of the next steps enqueued, one each (see
    /// [`PersistentEngine::set_step_lrs`]); after them, `optimizer.lr`.
    step_lrs: VecDeque<f64>,
    steps: u64,
    buffer: PoolBuffer<f32>,
    barriers: PoolBuffer<u32>,
    /// Where the batches' scripts are copied, beside the kernels running on
    /// the device's stream.
    copy_stream: Arc<CudaStream>,
    /// Host-side buffers of the batches in flight (made as more batches
    /// are queued at once; a slot is reused once its batch came back).
    slots: Vec<Slot>,
    /// Staging for the parameter region (downloads, growing the pool).
    transfer: PinnedBuffer,
    /// Submitted batches whose loss has not been read, oldest first.
    pending: VecDeque<Pending>,
    /// See [`PersistentOptions::host_items`].
    host_items: usize,
    /// Batches end with their gradients in the pool, not updated (see
    /// [`PersistentEngine::defer_updates`]).
    defer_updates: bool,
    /// Batches prepared ahead of their launch, with their vertex counts
    /// (see [`PersistentEngine::prepare_window`]).
    prepared: VecDeque<(usize, batch::PreparedBatch)>,
    /// Traced launches so far (the trace's launch numbers).
    traced_launches: u64,
    rng: ChaCha8Rng,
    fingerprint: Vec<usize>,
    setup_seconds: f64,
    /// Seconds the thread opening the device (the CUDA context) took.
    context_seconds: f64,
    /// When [`new`](PersistentEngine::new) started.
    created: Instant,
    /// While a bridge kernel is in use: the kernel proper it waits for.
    awaited: Option<AwaitedKernel>,
    /// Seconds from `created` until a kernel proper was in use.
    kernel_ready_seconds: Option<f64>,
    /// Batches read back that ran on a bridge kernel, and their kernels'
    /// seconds.
    bridge_batches: (usize, f64),
    /// See [`PersistentEngine::setup_phases`].
    setup_phases: Vec<(&'static str, f64)>,
}

/// The kernel proper a bridge kernel stands in for: the first choice and
/// the source of its first plan (compiling on another thread).
struct AwaitedKernel {
    choice: VariantChoice,
    source: String,
}

/// One batch in flight: its staged upload, the device copy of its scripts,
/// where its loss is copied back, and events around its launch (the
/// kernel's own time).
struct Slot {
    /// `None` while a preparing thread has it.
    staging: Option<PinnedBuffer>,
    /// The batch's scripts (and update scripts) on the device: a buffer
    /// per slot, so that they are copied on the copy stream while the batch
    /// before still runs (`None` until the slot's first batch).
    scripts: Option<PoolBuffer<u32>>,
    /// Recorded on the copy stream when the scripts are there.
    scripts_copied: CudaEvent,
    loss: PinnedBuffer,
    /// The batch's fault word, copied back with the loss.
    fault: PinnedBuffer,
    events: (CudaEvent, CudaEvent),
}

/// A submitted batch whose loss has not been read: its slot, its step (loss
/// still NaN), the variant it ran on and where in the pool its kernel
/// leaves its loss.
struct Pending {
    slot: usize,
    step: PersistentStep,
    variant: usize,
    loss_at: usize,
}

impl PersistentEngine {
    /// The pool's counters (bytes reserved, in use, the peak in use).
    pub fn pool_stats(&self) -> crate::pool::PoolStats {
        self.pool.stats()
    }

    /// Seconds [`new`](Self::new) took (kernel from the cache or compiled).
    pub fn setup_seconds(&self) -> f64 {
        self.setup_seconds
    }

    /// Seconds of [`setup_seconds`](Self::setup_seconds) spent opening the
    /// device (creating its CUDA context), which every engine pays.
    pub fn context_seconds(&self) -> f64 {
        self.context_seconds
    }

    /// The register plan of the kernel in use.
    pub fn register_plan(&self) -> &RegisterPlan {
        self.variants[self.active].kernel.plan()
    }

    /// Registers per thread and residency of the kernel in use.
    pub fn kernel_report(&self) -> &super::KernelReport {
        self.variants[self.active].kernel.report()
    }

    /// Whether the kernel is still being chosen: a bridge kernel trains
    /// while the kernel proper compiles, or the profile-guided `rpw` search
    /// runs.
    pub fn tuning(&self) -> bool {
        self.tuning.is_some() || self.awaited.is_some()
    }

    /// Kernel seconds of the last batch whose loss came back.
    pub fn last_kernel_seconds(&self) -> Option<f64> {
        self.last_kernel_seconds
    }

    /// Restarts the dropout masks' random stream (as the other engines'
    /// `seed`).
    pub fn seed(&mut self, seed: u64) {
        self.rng = ChaCha8Rng::seed_from_u64(seed);
    }

    /// Seconds from the start of set-up until a kernel proper (not a
    /// bridge) was in use; `None` while the bridge still trains.
    pub fn kernel_ready_seconds(&self) -> Option<f64> {
        self.kernel_ready_seconds
    }

    /// Set-up's phases, each with the seconds from the start of set-up to
    /// its end: reading the device's properties, loading NVRTC, planning
    /// the program, compiling a bridge kernel (while the device opens on
    /// another thread), waiting for the device, starting the candidates'
    /// compiles, loading or building the first kernel, uploading the
    /// parameters.
    pub fn setup_phases(&self) -> &[(&'static str, f64)] {
        &self.setup_phases
    }

    /// Batches read back that ran on a bridge kernel, and their kernels'
    /// seconds in all.
    pub fn bridge_batches(&self) -> (usize, f64) {
        self.bridge_batches
    }

    /// The current parameter values (downloaded).
    pub fn params(&mut self, model: &Model) -> Result<Params<f32>> {
        let stream = self.device.stream().clone();
        let total = self.prog.params.total;
        let all = self
            .transfer
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
