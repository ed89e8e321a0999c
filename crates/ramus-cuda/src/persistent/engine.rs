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
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream};
use ramus_codegen::persistent::{
    kernel_source, KernelOptions, UpdateRule, KERNEL_NAME, TRACE_AT, TRACE_RECORD_WORDS,
    TRACE_WORDS_PER_CTA,
};
use ramus_core::vpps::{
    isa::PRODUCT_ITEM_WORDS, plan, valid_rpws, BatchScripts, DeviceLimits, PlanRequest,
    RegisterPlan, Scheduler, WIDE_PRODUCT_ITEMS,
};
use ramus_core::{Model, Params, Tensor};
use ramus_exec::memory::DeviceRoom;
use ramus_exec::{OptimizerConfig, OptimizerKind};
use ramus_graph::{BatchingPolicy, InputGraph, Schedule};

mod resume;
mod sizes;

use super::program::PersistentProgram;
use super::unroll::{dropout_draws, unroll_batch, BatchProgram, GradientGemm, HostWork};
use super::{MatrixSlots, PersistentKernel, UpdateScalars};
use crate::blas::{Blas, Gemm};
use crate::cache::{compile_in_background, KernelCache, Prefetched};
use crate::device::CudaDevice;
use crate::error::{CudaError, InCall, Result};
use crate::memory::{device_room, local_memory_bytes, model_fits, run_check, DeviceCheck};
use crate::pinned::PinnedBuffer;
use crate::pool::{DevicePool, DeviceView, PoolBuffer, PoolConfig};
use crate::rtc::{supported_archs, CompileTarget, LoadedModule, NvrtcCompiler};

/// How to set up a [`PersistentEngine`].
#[derive(Clone, Debug, Default)]
pub struct PersistentOptions {
    /// Device ordinal.
    pub device: usize,
    /// Rows per warp of the register partitions (default: the choice of
    /// the profile-guided search, remembered in the kernel cache).
    pub rpw: Option<usize>,
    /// CTAs per SM (default: chosen from the weights' size).
    pub ctas_per_sm: Option<usize>,
    /// Kernel cache directory (default: the user cache).
    pub cache_dir: Option<PathBuf>,
    /// Keep the weight gradients in registers (default: where they fit);
    /// without, the outer products go to cuBLAS after the kernel and a
    /// second launch updates the cached matrices (VPPS §III-C2).
    pub grads_in_registers: Option<bool>,
    /// Items from which a product instruction runs as a tiled GEMM over
    /// its matrix's holders instead of on the held rows (default:
    /// [`WIDE_PRODUCT_ITEMS`], or the `RAMUS_VPPS_WIDE` environment
    /// variable for tuning; `Some(u32::MAX)`: never).
    pub wide_items: Option<u32>,
    /// Items from which a level's product (or, with register gradients, a
    /// weight-gradient product) runs as one cuBLAS GEMM between two
    /// launches of the kernel instead of inside it (default:
    /// [`HOST_PRODUCT_ITEMS`], or the `RAMUS_VPPS_HOST` environment
    /// variable for tuning; `Some(usize::MAX)`: never).
    pub host_items: Option<usize>,
    /// The batch size the engine will train on, if known. The `rpw`
    /// search times the first batches submitted, so its choice suits their
    /// size: a choice is remembered per batch-size class (powers of two),
    /// and a later run of another class searches again: the best plan for
    /// a batch of 1 is not the best for 128
    /// (`docs/benchmarks.md#persistent-engine-rpw-search`).
    pub batch_size: Option<usize>,
    /// Where the kernel must be compiled (no cached image), train the first
    /// batches on a bridge kernel, the same source compiled in a fraction
    /// of the time ([`PersistentKernel::bridge`]), while the kernel proper
    /// compiles on other threads (default: yes, unless tracing; NVRTC
    /// older than 12.8 cannot, and then set-up waits for the kernel).
    pub bridge: Option<bool>,
    /// Device memory the engine may take at most (its pool's budget, and
    /// what [`PersistentEngine::with_check`] checks against besides the
    /// free memory); `None`: as much as the device has free.
    pub memory_budget: Option<u64>,
}

/// The key of a remembered `rpw` choice: `base` (model, kernel, device
/// and options) and the batch-size class, the power of two at or above
/// [`PersistentOptions::batch_size`]; without one, `base` alone (the key
/// of earlier versions).
fn choice_key(base: String, batch_size: Option<usize>) -> String {
    match batch_size {
        Some(b) => format!("{base}|batch {}", b.max(1).next_power_of_two()),
        None => base,
    }
}

/// What one training batch did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PersistentStep {
    /// Mean loss over the batch's head rows (NaN until the batch is back).
    pub loss: f64,
    /// Host seconds to schedule, lower and encode the batch.
    pub host_seconds: f64,
    /// Device seconds of the batch's kernel launches (NaN until it is back).
    pub kernel_seconds: f64,
    /// Instructions of tasks (before merging) and barrier levels.
    pub tasks: usize,
    pub levels: usize,
    /// An update met a non-finite gradient or value (the kernel's fault
    /// word; false until the batch is back).
    pub nonfinite: bool,
}

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
/// still NaN) and the variant it ran on.
struct Pending {
    slot: usize,
    step: PersistentStep,
    variant: usize,
}

/// One batch lowered, scheduled and staged on the host, ready to launch.
struct PreparedBatch {
    variant: usize,
    /// The slot whose staging buffer holds the batch's words.
    slot: usize,
    /// Tasks of the batch's graph (the graph itself is freed once staged).
    tasks: usize,
    /// The batch's layout and gradient products (graphs and words freed).
    batch: BatchProgram,
    /// The batch's launches, one unless it has host work (see
    /// [`ramus_core::vpps::split_launches`]).
    launches: Vec<LaunchScripts>,
    /// Without register gradients: the matrices' update, a last script.
    updates: Option<BatchScripts>,
    host_seconds: f64,
}

/// One launch of a batch: its scripts (`None` for a launch with only host
/// work), `at` words into the slot's script buffer, and the indices of the
/// batch's host work ([`BatchProgram::host_work`]) that follows it.
struct LaunchScripts {
    scripts: Option<BatchScripts>,
    at: usize,
    host_after: Vec<u32>,
}

/// What preparing a batch reads: the model, its program and the variant
/// (index and scheduler) the batch is for. Nothing the device changes, and
/// nothing borrowed from the engine, so batches are prepared on any thread
/// while the engine launches the ones already prepared.
struct PrepareFor<'a> {
    model: &'a Model,
    prog: Arc<PersistentProgram>,
    variant: usize,
    scheduler: Arc<Scheduler>,
    in_registers: bool,
    host_items: usize,
}

impl<'a> PrepareFor<'a> {
    /// For batches of `model` on `engine`'s active variant.
    fn new(model: &'a Model, engine: &PersistentEngine) -> Self {
        let variant = engine.active;
        PrepareFor {
            model,
            prog: Arc::clone(&engine.prog),
            variant,
            scheduler: Arc::clone(&engine.variants[variant].scheduler),
            in_registers: engine.variants[variant].kernel.plan().grads_in_registers,
            host_items: engine.host_items,
        }
    }

    /// Lowers, levels and encodes one batch and stages its words (host
    /// words, scripts, update scripts: the pool's order from the upload
    /// region on) in slot `slot` (`staging`); `started` is when the host
    /// began preparing it.
    fn prepare(
        &self,
        schedule: &Schedule,
        rng: &mut ChaCha8Rng,
        slot: usize,
        staging: &mut PinnedBuffer,
        started: Instant,
    ) -> Result<PreparedBatch> {
        let scheduler = &self.scheduler;
        let in_registers = self.in_registers;
        let mut batch = unroll_batch(
            self.model,
            &self.prog,
            schedule,
            in_registers,
            scheduler.vpps,
            self.host_items,
            rng,
        )?;
        let tasks = batch.graph.len();
        let (launches, updates) = sizes::schedule_batch(scheduler, &mut batch, in_registers)?;
        let update_words = updates.as_ref().map_or(&[][..], |u| &u.packed.words[..]);
        let mut parts = vec![&batch.upload[..]];
        parts.extend(
            launches
                .iter()
                .filter_map(|l| Some(&l.scripts.as_ref()?.packed.words[..])),
        );
        parts.push(update_words);
        // waits for this slot's previous upload to have been copied
        let host = staging.host_mut::<u32>(parts.iter().map(|p| p.len()).sum())?;
        let mut at = 0;
        for words in parts {
            host[at..at + words.len()].copy_from_slice(words);
            at += words.len();
        }
        // the task graphs and host words are staged: freed here, in the
        // preparing threads, not one batch after another (tens of thousands
        // of small vectors each) on the thread that launches the window
        drop(std::mem::take(&mut batch.matrix_updates));
        drop(std::mem::take(&mut batch.upload));
        Ok(PreparedBatch {
            variant: self.variant,
            slot,
            tasks,
            batch,
            launches,
            updates,
            host_seconds: started.elapsed().as_secs_f64(),
        })
    }
}

/// Schedules one batch's graphs (levels, as the trainer's batches are).
fn schedule_graphs(model: &Model, graphs: &[&InputGraph]) -> Result<Schedule> {
    if graphs.is_empty() {
        return Err(model_err("an empty batch"));
    }
    Ok(
        ramus_exec::Batch::new(model, graphs.to_vec(), BatchingPolicy::Cavs)
            .map_err(|e| model_err(format!("scheduling the batch: {e}")))?
            .schedule,
    )
}

/// One compiled kernel with its scheduler (their register plan).
struct Variant {
    kernel: PersistentKernel,
    /// Shared with the threads preparing batches.
    scheduler: Arc<Scheduler>,
}

/// Inputs to compile a variant for another `rpw`.
struct VariantBuild {
    limits: DeviceLimits,
    ctas_per_sm: Option<usize>,
    grads_in_registers: Option<bool>,
    rule: UpdateRule,
    slots: Vec<MatrixSlots>,
    /// Where the chosen `rpw` is remembered (in the kernel cache).
    choice_file: Option<PathBuf>,
    /// Where each launch's instruction trace is appended
    /// (`RAMUS_VPPS_TRACE`; see [`append_trace`]): kernels built traced.
    trace: Option<PathBuf>,
    /// See [`PersistentOptions::wide_items`].
    wide_items: u32,
    /// Whether kernels are tried with the vector epilogue first
    /// ([`KernelOptions::vector_epilogue`]; off with [`EPILOGUE_ENV`]).
    vector_epilogue: bool,
}

/// VPPS' profile-guided load granularity (§III-A1): time a few batches
/// with each valid `rpw` from 1 up (one that spills is skipped), keep the
/// best. Every candidate is timed: stopping at the first one slower than
/// the best so far missed a faster larger `rpw`
/// (`docs/benchmarks.md#persistent-engine-rpw-search`).
/// Where the CTAs per SM and the gradients' place are left open, each
/// `rpw` is also tried keeping two CTAs per SM when two with register
/// gradients spill (see [`VariantChoice::keep_ctas`]), and where the
/// gradients' place is open, with them in memory ([`VariantChoice::candidates`]);
/// a candidate whose plan equals one already timed is skipped.
struct Tuning {
    candidates: Vec<VariantChoice>,
    /// Candidate being timed (index into `candidates`).
    at: usize,
    /// Costs of the batches timed with it: kernel seconds and a share of
    /// the host's (see where [`PersistentEngine::tune`] is called).
    samples: Vec<f64>,
    /// Best `(median cost, variant index)` so far.
    best: Option<(f64, usize)>,
}

/// Batches timed per `rpw` candidate (the first, with compilation and
/// cold caches behind it, is dropped; the median of the rest counts, so
/// one slow batch does not decide; with the mean of three, runs of the
/// same search kept different variants:
/// `docs/benchmarks.md#persistent-engine-rpw-search`).
const TUNE_BATCHES: usize = 6;
/// Most `rpw` values tried.
const TUNE_CANDIDATES: usize = 4;

/// What a variant is built for: `rpw`, the CTAs per SM and the gradients'
/// place where they are fixed (by the options or a remembered choice),
/// and how the open ones fall back when a kernel spills.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct VariantChoice {
    rpw: usize,
    ctas_per_sm: Option<usize>,
    grads_in_registers: Option<bool>,
    /// Where the plan's CTAs per SM with register gradients spill, give up
    /// the register gradients before a CTA per SM (else the other way
    /// round): either can be the faster
    /// (`docs/benchmarks.md#persistent-engine-rpw-search`).
    keep_ctas: bool,
}

impl VariantChoice {
    /// The search's candidates for `build` (at most [`TUNE_CANDIDATES`]
    /// `rpw` values, each also with `keep_ctas` where the CTAs per SM and
    /// the gradients' place are open, and with the gradients in memory
    /// from the first plan on where their place is open: where they fit in
    /// registers the other candidates never try that, and it can be the
    /// fastest for small batches:
    /// `docs/benchmarks.md#persistent-engine-rpw-search`).
    fn candidates(prog: &PersistentProgram, build: &VariantBuild) -> Vec<VariantChoice> {
        let grads_open = build.grads_in_registers.is_none();
        let open = build.ctas_per_sm.is_none() && grads_open;
        let mut rpws = valid_rpws(&prog.matrices, &build.limits);
        rpws.truncate(TUNE_CANDIDATES);
        rpws.into_iter()
            .flat_map(|rpw| {
                let choice = VariantChoice::of(build, rpw);
                let kept = VariantChoice {
                    keep_ctas: true,
                    ..choice
                };
                let in_memory = VariantChoice {
                    grads_in_registers: Some(false),
                    ..choice
                };
                std::iter::once(choice)
                    .chain(open.then_some(kept))
                    .chain(grads_open.then_some(in_memory))
            })
            .collect()
    }

    /// The first plan request of this choice.
    fn request(&self) -> PlanRequest {
        PlanRequest {
            rpw: self.rpw,
            ctas_per_sm: self.ctas_per_sm,
            grads_in_registers: self.grads_in_registers,
        }
    }

    /// The request to try after the plan of `request`, with `(ctas per SM,
    /// gradients in registers)` = `chosen`, failed (spilled or could not be
    /// resident): one CTA per SM fewer (twice the registers per thread),
    /// else the gradients outside registers, or with `keep_ctas` the other
    /// way round; `None` where this choice leaves neither open.
    fn fallback(&self, request: &PlanRequest, chosen: (usize, bool)) -> Option<PlanRequest> {
        let fewer_ctas = self.ctas_per_sm.is_none() && chosen.0 > 1;
        let grads_out = self.grads_in_registers.is_none() && chosen.1;
        let (ctas_per_sm, grads_in_registers) = if self.keep_ctas && grads_out {
            (Some(chosen.0), Some(false))
        } else if fewer_ctas {
            (Some(chosen.0 - 1), request.grads_in_registers)
        } else if grads_out {
            (self.ctas_per_sm, Some(false))
        } else {
            return None;
        };
        Some(PlanRequest {
            rpw: self.rpw,
            ctas_per_sm,
            grads_in_registers,
        })
    }

    /// `rpw` with `build`'s options and the default fallback.
    fn of(build: &VariantBuild, rpw: usize) -> Self {
        VariantChoice {
            rpw,
            ctas_per_sm: build.ctas_per_sm,
            grads_in_registers: build.grads_in_registers,
            keep_ctas: false,
        }
    }

    /// A remembered choice: `rpw ctas_per_sm grads_in_registers` (1 or 0);
    /// a bare `rpw` (written by earlier versions) keeps `build`'s options.
    fn parse(text: &str, build: &VariantBuild) -> Option<Self> {
        let words: Vec<usize> = text
            .split_whitespace()
            .map(|w| w.parse().ok())
            .collect::<Option<_>>()?;
        match words[..] {
            [rpw] => Some(VariantChoice::of(build, rpw)),
            [rpw, ctas, grads] => Some(VariantChoice {
                rpw,
                ctas_per_sm: Some(ctas),
                grads_in_registers: Some(grads != 0),
                keep_ctas: false,
            }),
            _ => None,
        }
    }
}

fn model_err(message: impl Into<String>) -> CudaError {
    CudaError::Model(message.into())
}

/// An item threshold: `given`, else the environment variable `env` (for
/// tuning; an error names a value that is not a number), else `default`.
fn items_option<T: std::str::FromStr>(given: Option<T>, env: &str, default: T) -> Result<T> {
    if let Some(items) = given {
        return Ok(items);
    }
    match std::env::var(env) {
        Ok(v) => v
            .trim()
            .parse::<T>()
            .map_err(|_| CudaError::BadArgument(format!("{env}={v:?} is not a number of items"))),
        Err(_) => Ok(default),
    }
}

fn rule_of(kind: OptimizerKind) -> UpdateRule {
    match kind {
        OptimizerKind::Sgd => UpdateRule::Sgd,
        OptimizerKind::Adagrad => UpdateRule::Adagrad,
        OptimizerKind::Adam => UpdateRule::Adam,
    }
}

impl PersistentEngine {
    /// Sets the engine up for `model` with initial `params` and `optimizer`
    /// (refusing a model whose parameters cannot fit the device; see
    /// [`with_check`](Self::with_check)).
    pub fn new(
        model: &Model,
        params: &Params<f32>,
        optimizer: OptimizerConfig,
        options: &PersistentOptions,
    ) -> Result<Self> {
        Self::with_check(model, params, optimizer, options, &model_fits)
    }

    /// [`new`](Self::new), asking `check` whether what the run will
    /// allocate fits the device ([`sizes::need`]; within
    /// [`PersistentOptions::memory_budget`] before the kernels compile,
    /// within the free memory once the device is open), before the pool
    /// holds anything: a refusal is [`CudaError::DoesNotFit`]. The pool
    /// then reserves what the check found fits, its buffer sized for the
    /// largest batch.
    pub fn with_check(
        model: &Model,
        params: &Params<f32>,
        optimizer: OptimizerConfig,
        options: &PersistentOptions,
        check: DeviceCheck<'_>,
    ) -> Result<Self> {
        let started = Instant::now();
        if optimizer.clip_norm.is_some() {
            return Err(model_err(
                "the persistent engine does not clip gradients yet; train without --clip-norm",
            ));
        }
        // the CUDA context is created on a thread of its own while this one
        // plans the kernel and, where it must be compiled, compiles a bridge
        let ordinal = options.device;
        let opening = std::thread::Builder::new()
            .name("ramus-cuda-open".into())
            .spawn(move || {
                let opened = Instant::now();
                CudaDevice::open(ordinal).map(|d| (d, opened.elapsed().as_secs_f64()))
            });
        let mut phases = Vec::new();
        let mut mark = |phase: &'static str| phases.push((phase, started.elapsed().as_secs_f64()));
        let facts = CudaDevice::probe(ordinal)?;
        mark("probe");
        let (major, minor) = facts.compute_capability;
        let compiler = NvrtcCompiler::for_target(CompileTarget::choose(
            major * 10 + minor,
            &supported_archs()?,
        )?);
        let cache_dir = options
            .cache_dir
            .clone()
            .or_else(crate::cache::default_cache_dir);
        mark("nvrtc");
        let prog = Arc::new(PersistentProgram::build(model)?);
        let limits = DeviceLimits::hopper(facts.sm_count as usize);
        let slots = sizes::matrix_slots(&prog)?;
        let rule = rule_of(optimizer.kind);
        let wide_items = items_option(options.wide_items, WIDE_ENV, WIDE_PRODUCT_ITEMS)?;
        let host_items = items_option(options.host_items, HOST_ENV, HOST_PRODUCT_ITEMS)?;
        // the choice of an earlier search for this model, kernel and device
        let choice_file = cache_dir.as_ref().map(|d| {
            let key = choice_key(
                format!(
                    "{}|{:?}|{:?}|{}|{:?}|{:?}|{wide_items}|{host_items}",
                    prog.fused_source,
                    prog.matrices,
                    rule,
                    facts.name,
                    options.ctas_per_sm,
                    options.grads_in_registers
                ),
                options.batch_size,
            );
            d.join(format!(
                "vpps-rpw-{:016x}",
                crate::cache::fnv1a64(key.as_bytes())
            ))
        });
        let remembered = choice_file
            .as_ref()
            .and_then(|f| std::fs::read_to_string(f).ok());
        let build = VariantBuild {
            limits,
            ctas_per_sm: options.ctas_per_sm,
            grads_in_registers: options.grads_in_registers,
            rule,
            slots,
            choice_file,
            trace: std::env::var_os(TRACE_ENV).map(PathBuf::from),
            wide_items,
            vector_epilogue: std::env::var(EPILOGUE_ENV).map_or(true, |v| v.trim() != "scalar"),
        };
        let remembered = remembered.and_then(|text| VariantChoice::parse(&text, &build));
        let (first_choice, tuning) = match (options.rpw, remembered) {
            (Some(rpw), _) => (VariantChoice::of(&build, rpw), None),
            (None, Some(choice)) => (choice, None),
            (None, None) => {
                let candidates = VariantChoice::candidates(&prog, &build);
                let first = candidates
                    .first()
                    .copied()
                    .unwrap_or(VariantChoice::of(&build, 1));
                let tuning = (candidates.len() > 1).then_some(Tuning {
                    candidates,
                    at: 0,
                    samples: Vec::new(),
                    best: None,
                });
                (first, tuning)
            }
        };
        mark("program");
        let choices = tuning
            .as_ref()
            .map_or_else(|| vec![first_choice], |t| t.candidates.clone());
        let mut need = sizes::need(model, &prog, &build, &choices, host_items)?;
        if let Some(budget) = options.memory_budget {
            // a run over the budget is refused before anything compiles
            // (once the thread opening the device is done with the driver)
            let room = DeviceRoom {
                free: u64::MAX,
                budget: Some(budget),
            };
            if let Err(e) = run_check(check, &need, room) {
                if let Ok(thread) = opening {
                    let _ = thread.join();
                }
                return Err(e);
            }
        }
        let mut early = start_compiles(
            &prog,
            &build,
            first_choice,
            &compiler,
            cache_dir.as_deref(),
            options.bridge != Some(false) && build.trace.is_none(),
        );
        mark("bridge compile");
        let (device, context_seconds) = match opening {
            Ok(thread) => thread
                .join()
                .map_err(|_| model_err("the thread opening the device panicked"))??,
            Err(_) => {
                let opened = Instant::now();
                (CudaDevice::open(ordinal)?, opened.elapsed().as_secs_f64())
            }
        };
        // the context was made current on the thread that created it
        device
            .context()
            .bind_to_thread()
            .in_call("cuCtxSetCurrent")?;
        mark("device");
        let pooled = need.parts_bytes();
        let budget = options.memory_budget;
        let (fitted, bridge) = check_opened(&device, &mut need, &mut early, check, budget)?;
        let cache = KernelCache::with_compiler(&device, compiler, cache_dir);
        // what the check found fits, in one chunk
        let checked = pooled + fitted.train_batch + fitted.train_extra;
        let pool = DevicePool::new(
            &device,
            PoolConfig {
                initial_bytes: PoolConfig::default().initial_bytes.max(checked),
                max_bytes: options.memory_budget,
            },
        );
        if let Some(e) = early.as_mut() {
            // where no thread could compile it early, the lookup compiles it
            for (source, compiling) in e.kernel_proper.drain(..) {
                cache.adopt(&source, &[KERNEL_NAME], compiling)?;
            }
        }
        if let Some(t) = &tuning {
            prefetch_candidates(&cache, &prog, &build, &t.candidates);
        }
        mark("prefetch");
        let (first, awaited) = match (early, bridge) {
            (Some(EarlyCompiles { plan, source, .. }), Some((module, compile_started))) => {
                let kernel = PersistentKernel::bridge(
                    &device,
                    &pool,
                    plan,
                    &module,
                    &build.slots,
                    compile_started,
                )?;
                let scheduler = Arc::new(variant_scheduler(kernel.plan(), &build));
                let awaited = AwaitedKernel {
                    choice: first_choice,
                    source,
                };
                (Variant { kernel, scheduler }, Some(awaited))
            }
            _ => (
                build_variant(&device, &cache, &pool, &prog, &build, first_choice)?,
                None,
            ),
        };
        if params.values.len() != model.params.len() {
            return Err(model_err(format!(
                "{} parameter tensors for a model of {}",
                params.values.len(),
                model.params.len()
            )));
        }
        // parameters, zero gradients and moments, then room for batches
        mark("kernel");
        let capacity = sizes::buffer_floats(prog.params.total, fitted.train_batch);
        let buffer = pool.alloc::<f32>(capacity)?;
        let mut transfer = PinnedBuffer::new(&device)?;
        {
            let host = transfer.host_mut::<f32>(prog.params.total)?;
            host.iter_mut().for_each(|x| *x = 0.0);
            for (p, t) in params.values.iter().enumerate() {
                let at = prog.params.value[p];
                host[at..at + t.data().len()].copy_from_slice(t.data());
            }
        }
        transfer.upload(buffer.view().slice(0..prog.params.total)?, device.stream())?;
        let barriers = pool.alloc::<u32>(1024)?;
        let copy_stream = device.new_stream()?;
        transfer.wait()?;
        mark("upload");
        Ok(PersistentEngine {
            device,
            cache,
            pool,
            prog,
            variants: vec![first],
            active: 0,
            tuning,
            build,
            last_kernel_seconds: None,
            blas: None,
            optimizer,
            steps: 0,
            buffer,
            barriers,
            copy_stream,
            slots: Vec::new(),
            transfer,
            pending: VecDeque::new(),
            host_items,
            traced_launches: 0,
            rng: ChaCha8Rng::seed_from_u64(0),
            fingerprint: crate::program::fingerprint(model),
            setup_seconds: started.elapsed().as_secs_f64(),
            context_seconds,
            kernel_ready_seconds: awaited.is_none().then(|| started.elapsed().as_secs_f64()),
            created: started,
            awaited,
            bridge_batches: (0, 0.0),
            setup_phases: phases,
        })
    }

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

    /// Trains on one batch: forward, backward and the optimizer step in one
    /// kernel launch. Returns once this batch's loss is back (see
    /// [`submit`](Self::submit) for the overlapped form).
    pub fn train_batch(&mut self, model: &Model, graphs: &[&InputGraph]) -> Result<PersistentStep> {
        self.submit(model, graphs)?;
        self.latest()?
            .ok_or_else(|| model_err("the submitted batch has no loss"))
    }

    /// VPPS' training call: prepares and enqueues one batch (forward,
    /// backward and update in one launch, or a few around host GEMMs) and returns the *previous*
    /// batch's step, if one was pending (the oldest pending one after a
    /// [`submit_many`](Self::submit_many)) — so the host prepares the next
    /// batch while the device runs this one. [`latest`](Self::latest)
    /// waits for the last one.
    pub fn submit(
        &mut self,
        model: &Model,
        graphs: &[&InputGraph],
    ) -> Result<Option<PersistentStep>> {
        let started = Instant::now();
        let schedule = schedule_graphs(model, graphs)?;
        self.submit_scheduled(model, &schedule, started)
    }

    /// [`submit`](Self::submit) for a batch already scheduled (levels);
    /// `started` is when the host began preparing it.
    pub fn submit_scheduled(
        &mut self,
        model: &Model,
        schedule: &Schedule,
        started: Instant,
    ) -> Result<Option<PersistentStep>> {
        self.check_model(model)?;
        self.take_up_kernel(false)?;
        let slot = self.free_slots(1)?[0];
        let prepare = PrepareFor::new(model, self);
        let mut staging = self.take_staging(slot)?;
        let prepared = prepare.prepare(schedule, &mut self.rng, slot, &mut staging, started);
        self.slots[slot].staging = Some(staging);
        self.enqueue(prepared?)?;
        if self.pending.len() > 1 {
            self.pop_oldest().map(Some)
        } else {
            Ok(None)
        }
    }

    /// Submits a window of batches (each a list of graphs): schedules,
    /// lowers and encodes all of them in parallel on the host's cores,
    /// queues them in order behind the batches still running, and returns
    /// the steps of every batch submitted *before* this call, oldest first
    /// (waiting for them) — so the host prepares window `k + 1` while the
    /// device runs window `k`. Dropout masks are drawn exactly as one
    /// [`submit`](Self::submit) per batch would draw them.
    /// [`finish`](Self::finish) returns the last window's steps.
    pub fn submit_many(
        &mut self,
        model: &Model,
        batches: &[Vec<&InputGraph>],
    ) -> Result<Vec<PersistentStep>> {
        let started = Instant::now();
        let schedules = batches
            .par_iter()
            .with_max_len(1)
            .map(|graphs| schedule_graphs(model, graphs))
            .collect::<Result<Vec<Schedule>>>()?;
        let refs: Vec<&Schedule> = schedules.iter().collect();
        self.submit_many_scheduled(model, &refs, started)
    }

    /// [`submit_many`](Self::submit_many) for batches already scheduled;
    /// `started` is when the host began preparing them. While a bridge
    /// kernel trains (see [`PersistentOptions::bridge`]), the batches go
    /// one at a time, as [`submit`](Self::submit)s, and the steps returned
    /// are those of every batch but the last one submitted.
    pub fn submit_many_scheduled(
        &mut self,
        model: &Model,
        schedules: &[&Schedule],
        started: Instant,
    ) -> Result<Vec<PersistentStep>> {
        self.check_model(model)?;
        self.take_up_kernel(false)?;
        if self.awaited.is_some() {
            // a bridge kernel trains one batch at a time (two in flight),
            // so that the kernel proper takes over as soon as it is ready:
            // a bridge batch can take a hundred times as long
            // (each batch's host time from its own start: once the kernel
            // proper takes over, the search weighs it)
            let mut steps = Vec::new();
            for schedule in schedules {
                steps.extend(self.submit_scheduled(model, schedule, Instant::now())?);
            }
            return Ok(steps);
        }
        // each batch's dropout masks continue the stream where the previous
        // batch's end (two words per draw)
        let mut rngs = Vec::with_capacity(schedules.len());
        for s in schedules {
            rngs.push(self.rng.clone());
            let words = 2 * dropout_draws(model, s);
            self.rng.set_word_pos(self.rng.get_word_pos() + words);
        }
        // each batch staged in a slot of its own by the thread preparing it;
        // the batches are prepared in parallel and each is launched as soon
        // as it and every batch before it are ready (not when the slowest of
        // the window is), so the device waits on the host as little as the
        // host's stragglers allow
        let chosen = self.free_slots(schedules.len())?;
        let mut jobs = Vec::with_capacity(chosen.len());
        for ((i, &slot), rng) in chosen.iter().enumerate().zip(rngs) {
            match self.take_staging(slot) {
                Ok(staging) => jobs.push((i, slot, rng, staging)),
                Err(e) => {
                    for (_, slot, _, staging) in jobs {
                        self.slots[slot].staging = Some(staging);
                    }
                    return Err(e);
                }
            }
        }
        let prepare = PrepareFor::new(model, self);
        let earlier = self.pending.len();
        let (sender, ready) = std::sync::mpsc::channel();
        let launched = std::thread::scope(|scope| {
            scope.spawn(|| {
                jobs.into_par_iter()
                    // one batch per job, so that no thread holds two
                    // batches while another waits
                    .with_max_len(1)
                    .for_each_with(sender, |sender, (i, slot, mut rng, mut staging)| {
                        let prepared =
                            prepare.prepare(schedules[i], &mut rng, slot, &mut staging, started);
                        // the receiver outlives every job (it drains them all)
                        let _ = sender.send((i, slot, staging, prepared));
                    });
            });
            self.launch_in_order(ready, schedules.len())
        });
        launched?;
        (0..earlier).map(|_| self.pop_oldest()).collect()
    }

    /// Receives `count` prepared batches (window position, slot, its staging
    /// buffer, the batch) in any order, gives every slot its buffer back and
    /// launches the batches in window order as soon as each one and all
    /// before it are there; after a failed one, launches no more (and
    /// returns its error, once every buffer is back).
    fn launch_in_order(
        &mut self,
        ready: std::sync::mpsc::Receiver<(usize, usize, PinnedBuffer, Result<PreparedBatch>)>,
        count: usize,
    ) -> Result<()> {
        let mut waiting: Vec<Option<PreparedBatch>> = (0..count).map(|_| None).collect();
        let mut next = 0;
        let mut failed = None;
        for (i, slot, staging, prepared) in ready {
            self.slots[slot].staging = Some(staging);
            match prepared {
                Ok(p) => waiting[i] = Some(p),
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
            while failed.is_none() && next < count {
                let Some(p) = waiting[next].take() else {
                    break;
                };
                if let Err(e) = self.enqueue(p) {
                    failed = Some(e);
                }
                next += 1;
            }
        }
        match failed {
            Some(e) => Err(e),
            None if next < count => Err(model_err(format!(
                "{} of {count} batches of the window were never prepared",
                count - next
            ))),
            None => Ok(()),
        }
    }

    /// Slot `slot`'s staging buffer (an error while it is lent out).
    fn staging(&mut self, slot: usize) -> Result<&mut PinnedBuffer> {
        self.slots[slot]
            .staging
            .as_mut()
            .ok_or_else(|| model_err(format!("slot {slot}'s staging buffer is lent out")))
    }

    /// Slot `slot`'s staging buffer, lent to the thread preparing its batch.
    fn take_staging(&mut self, slot: usize) -> Result<PinnedBuffer> {
        self.slots[slot]
            .staging
            .take()
            .ok_or_else(|| model_err(format!("slot {slot}'s staging buffer is already lent")))
    }

    /// Errors unless `model` is the one the engine was set up for.
    fn check_model(&self, model: &Model) -> Result<()> {
        if crate::program::fingerprint(model) != self.fingerprint {
            return Err(model_err(
                "the batch is for a different model than the engine was set up for",
            ));
        }
        Ok(())
    }

    /// `n` slots no pending batch uses, ascending (new ones where too few
    /// are free).
    fn free_slots(&mut self, n: usize) -> Result<Vec<usize>> {
        let mut free: Vec<usize> = (0..self.slots.len())
            .filter(|&i| !self.pending.iter().any(|p| p.slot == i))
            .take(n)
            .collect();
        while free.len() < n {
            let event = || {
                self.device
                    .context()
                    .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .in_call("cuEventCreate")
            };
            self.slots.push(Slot {
                staging: Some(PinnedBuffer::new(&self.device)?),
                scripts: None,
                scripts_copied: self.device.new_event()?,
                loss: PinnedBuffer::new(&self.device)?,
                fault: PinnedBuffer::new(&self.device)?,
                events: (event()?, event()?),
            });
            free.push(self.slots.len() - 1);
        }
        Ok(free)
    }

    /// Uploads a prepared batch (its scripts to its slot's buffer on the
    /// copy stream, while the batches before it still run; its staged
    /// words to the pool behind them), zeroes its accumulation region and
    /// launches it on the stream, behind the batches still running; the
    /// batch joins `pending`.
    fn enqueue(&mut self, prepared: PreparedBatch) -> Result<()> {
        let PreparedBatch {
            variant,
            slot,
            tasks,
            batch,
            launches,
            updates,
            host_seconds,
        } = prepared;

        // the pool: parameters, then the batch's regions; the slot's
        // buffer: each launch's scripts, then the update scripts
        self.ensure_capacity(batch.end)?;
        let launched = || launches.iter().filter_map(|l| l.scripts.as_ref());
        let update_at: usize = launched().map(|s| s.packed.words.len()).sum();
        let levels = launched().map(|s| s.levels).sum();
        let script_words = sizes::script_words(&launches, updates.as_ref());
        // the slot's batch before this one is done (its loss was read); a
        // new buffer may be memory the pool took back from work still
        // queued on the stream (it reuses freed blocks at once), so the
        // copy stream first waits for that work
        let script_buffer = match self.slots[slot].scripts.take() {
            Some(b) if b.len() >= script_words => b,
            _ => {
                let b = self
                    .pool
                    .alloc::<u32>(sizes::script_buffer_words(script_words))?;
                let queued = self.device.new_event()?;
                queued
                    .record(self.device.stream())
                    .in_call("cuEventRecord")?;
                self.copy_stream
                    .wait(&queued)
                    .in_call("cuStreamWaitEvent")?;
                b
            }
        };
        let script_view = script_buffer.view().slice(0..script_words)?;
        self.slots[slot].scripts = Some(script_buffer);
        let traced = self.build.trace.is_some();
        let ctas = self.variants[variant].kernel.plan().ctas;
        let barriers = sizes::barrier_words(&launches, updates.as_ref(), traced.then_some(ctas));
        if self.barriers.len() < barriers {
            self.barriers = self.pool.alloc::<u32>(barriers.next_power_of_two())?;
        }
        let stream = self.device.stream().clone();
        let view = self.buffer.view();
        // the words were staged in order when the batch was prepared: the
        // pool's, then the scripts; the pool's copy follows the scripts'
        // (so the staging buffer's next use waits for both)
        let pool_words = batch.end - batch.upload_at;
        let copy_stream = Arc::clone(&self.copy_stream);
        self.staging(slot)?
            .upload_from(pool_words, script_view, &copy_stream)?;
        let copied = &self.slots[slot].scripts_copied;
        copied.record(&copy_stream).in_call("cuEventRecord")?;
        stream.wait(copied).in_call("cuStreamWaitEvent")?;
        let words: DeviceView<u32> = view.slice(batch.upload_at..batch.end)?.reinterpret();
        self.staging(slot)?.upload(words, &stream)?;
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
            fault_at: u32::try_from(batch.fault_at)
                .map_err(|_| model_err("the batch's fault word is past 2^32 floats"))?,
        };
        self.slots[slot]
            .events
            .0
            .record(&stream)
            .in_call("cuEventRecord")?;
        // register gradients outlive no launch: every launch before the
        // last one with kernel work hands them to the pool's accumulator
        let in_registers = self.variants[variant].kernel.plan().grads_in_registers;
        let last_kernel = launches.iter().rposition(|l| l.scripts.is_some());
        for (i, launch) in launches.iter().enumerate() {
            if let Some(scripts) = &launch.scripts {
                let words = scripts.packed.words.len();
                self.variants[variant].kernel.launch(
                    view,
                    script_view.slice(launch.at..launch.at + words)?,
                    &scripts.packed,
                    self.barriers.view(),
                    &scalars,
                    in_registers && Some(i) != last_kernel,
                )?;
                self.trace_launch(variant, slot)?;
            }
            self.host_work(&batch.host_work, &launch.host_after, view)?;
        }
        if let Some(updates) = &updates {
            self.gradient_products(&batch.gemms, view)?;
            let script = script_view.slice(update_at..script_words)?;
            self.variants[variant].kernel.launch(
                view,
                script,
                &updates.packed,
                self.barriers.view(),
                &scalars,
                false,
            )?;
        }
        self.slots[slot]
            .events
            .1
            .record(&stream)
            .in_call("cuEventRecord")?;
        self.slots[slot]
            .loss
            .download(view.slice(batch.loss_at..batch.loss_at + 1)?, &stream)?;
        let fault: DeviceView<u32> = view
            .slice(batch.fault_at..batch.fault_at + 1)?
            .reinterpret();
        self.slots[slot].fault.download(fault, &stream)?;
        let step = PersistentStep {
            loss: f64::NAN,
            host_seconds,
            kernel_seconds: f64::NAN,
            tasks,
            levels,
            nonfinite: false,
        };
        self.pending.push_back(Pending {
            slot,
            step,
            variant,
        });
        Ok(())
    }

    /// Traced kernels: appends the launch just enqueued's records, read
    /// before the next launch writes its own over them.
    fn trace_launch(&mut self, variant: usize, slot: usize) -> Result<()> {
        let Some(path) = self.build.trace.clone() else {
            return Ok(());
        };
        let ctas = self.variants[variant].kernel.plan().ctas;
        let records = self
            .barriers
            .view()
            .slice(TRACE_AT..TRACE_AT + TRACE_WORDS_PER_CTA * ctas)?;
        let stream = self.device.stream().clone();
        let words = self.staging(slot)?.download_to_vec(records, &stream)?;
        self.traced_launches += 1;
        append_trace(&path, self.traced_launches, &words)
    }

    /// cuBLAS, made at first use.
    fn ensure_blas(&mut self) -> Result<()> {
        if self.blas.is_none() {
            self.blas = Some(Blas::new(&self.device, self.device.stream().clone())?);
        }
        Ok(())
    }

    /// The host work `which` (indices into `work`) on the stream: each
    /// product as one cuBLAS GEMM with the weights' master copy in the pool.
    fn host_work(&mut self, work: &[HostWork], which: &[u32], view: DeviceView<f32>) -> Result<()> {
        if which.is_empty() {
            return Ok(());
        }
        self.ensure_blas()?;
        let Some(blas) = self.blas.as_ref() else {
            return Ok(());
        };
        for &i in which {
            let item = work
                .get(i as usize)
                .ok_or_else(|| model_err(format!("host task names work {i} of {}", work.len())))?;
            match *item {
                HostWork::Gradient(g) => gradient_gemm(blas, &self.prog, &g, view)?,
                HostWork::Product {
                    matrix,
                    transposed,
                    rows,
                    input,
                    input_stride,
                    output,
                    output_stride,
                } => {
                    let spec = &self.prog.matrices[usize::from(matrix)];
                    // y = x Wᵀ (W: n × k) or y = x W (W: k × n)
                    let (n, k) = match transposed {
                        false => (spec.rows, spec.cols),
                        true => (spec.cols, spec.rows),
                    };
                    if rows == 0 {
                        continue;
                    }
                    let span = |at: usize, stride: usize, width: usize| {
                        view.slice(at..at + (rows - 1) * stride + width)
                    };
                    let value = self.prog.params.value[spec.param];
                    let gemm = Gemm {
                        trans_b: !transposed,
                        beta: 1.0,
                        lda: Some(input_stride),
                        ldc: Some(output_stride),
                        ..Gemm::new(rows, n, k)
                    };
                    blas.sgemm(
                        &gemm,
                        span(input, input_stride, k)?,
                        view.slice(value..value + spec.rows * spec.cols)?,
                        span(output, output_stride, n)?,
                    )?;
                }
            }
        }
        Ok(())
    }

    /// The cached matrices' weight gradients with cuBLAS (a plan without
    /// register gradients): `grad += Aᵀ B` per product, on the stream.
    fn gradient_products(&mut self, gemms: &[GradientGemm], view: DeviceView<f32>) -> Result<()> {
        self.ensure_blas()?;
        let Some(blas) = self.blas.as_ref() else {
            return Ok(());
        };
        for g in gemms {
            gradient_gemm(blas, &self.prog, g, view)?;
        }
        Ok(())
    }

    /// Waits for the last submitted batch and returns its step (its loss
    /// included); `None` if every submitted batch was already returned.
    pub fn latest(&mut self) -> Result<Option<PersistentStep>> {
        Ok(self.finish()?.pop())
    }

    /// Waits for every submitted batch and returns the steps not returned
    /// yet, oldest first.
    pub fn finish(&mut self) -> Result<Vec<PersistentStep>> {
        (0..self.pending.len()).map(|_| self.pop_oldest()).collect()
    }

    /// The oldest pending batch's step with the loss its slot's copy
    /// brought back (waits for it); feeds the kernel's time to the `rpw`
    /// search.
    fn pop_oldest(&mut self) -> Result<PersistentStep> {
        let Pending {
            slot,
            step,
            variant,
        } = self
            .pending
            .pop_front()
            .ok_or_else(|| model_err("no submitted batch is pending"))?;
        let loss = f64::from(self.slots[slot].loss.host::<f32>(1)?[0]);
        let nonfinite = self.slots[slot].fault.host::<u32>(1)?[0] != 0;
        let (start, end) = &self.slots[slot].events;
        let ms = start.elapsed_ms(end).in_call("cuEventElapsedTime")?;
        let seconds = f64::from(ms) / 1e3;
        self.last_kernel_seconds = Some(seconds);
        if self.variants[variant].kernel.report().bridge {
            self.bridge_batches.0 += 1;
            self.bridge_batches.1 += seconds;
        }
        if self.tuning.is_some() {
            // the search's cost of a batch: its device time and its share
            // of the host's preparation (one core's time over the batches
            // prepared in parallel). At large batches some models are
            // host-bound, and a plan with twice the processors cuts a wide
            // level into twice the instructions, so the device time alone
            // chose a plan that trained slower
            // (docs/benchmarks.md#persistent-engine-rpw-search)
            let share = step.host_seconds / super::train::prepared_ahead() as f64;
            self.tune(variant, seconds + share)?;
        }
        Ok(PersistentStep {
            loss,
            nonfinite,
            kernel_seconds: seconds,
            ..step
        })
    }

    /// One timed batch of `variant` for the `rpw` search, costing `cost`
    /// seconds: after [`TUNE_BATCHES`] of the current candidate, moves on
    /// to the next one (compiling it) or settles on the best and remembers
    /// it.
    fn tune(&mut self, variant: usize, cost: f64) -> Result<()> {
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
    fn next_candidate(&mut self, from: usize) -> (bool, Option<CudaError>) {
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
    fn build_choice(&self, choice: VariantChoice) -> Result<Variant> {
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
    fn activate(&mut self, variant: Variant) {
        self.variants.push(variant);
        self.active = self.variants.len() - 1;
    }

    /// While a bridge kernel is in use: once the kernel proper it waits for
    /// is compiled (or at once, `wait`ing for it), builds it (with the
    /// `rpw` search running, its first candidate that builds) and makes it
    /// the one in use.
    fn take_up_kernel(&mut self, wait: bool) -> Result<()> {
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
    /// kernel training while it compiled (see [`PersistentOptions::bridge`]).
    pub fn wait_for_kernel(&mut self) -> Result<()> {
        self.take_up_kernel(true)
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

    /// Ends the `rpw` search on variant `best` and remembers its plan's
    /// `rpw`, CTAs per SM and gradients' place.
    fn settle(&mut self, best: usize) {
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

    /// Grows the pool buffer to `floats`, keeping the parameter region.
    fn ensure_capacity(&mut self, floats: usize) -> Result<()> {
        if floats <= self.buffer.len() {
            return Ok(());
        }
        let stream = self.device.stream().clone();
        let total = self.prog.params.total;
        let kept = self
            .transfer
            .download_to_vec(self.buffer.view().slice(0..total)?, &stream)?;
        let bigger = self.pool.alloc::<f32>(sizes::grown_buffer_floats(floats))?;
        self.transfer
            .upload_slice(&kept, bigger.view().slice(0..total)?, &stream)?;
        self.transfer.wait()?;
        self.buffer = bigger;
        Ok(())
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

/// `grad[m] += Aᵀ B` for one weight-gradient product `g` (see
/// [`GradientGemm`]), into the matrix's gradient slot in the pool.
fn gradient_gemm(
    blas: &Blas,
    prog: &PersistentProgram,
    g: &GradientGemm,
    view: DeviceView<f32>,
) -> Result<()> {
    let spec = &prog.matrices[usize::from(g.matrix)];
    let (rows, cols) = (spec.rows, spec.cols);
    let grad = prog.params.grad[spec.param]
        .ok_or_else(|| model_err("a cached matrix without a gradient slot"))?;
    if g.rows == 0 {
        return Ok(());
    }
    let span =
        |at: usize, stride: usize, width: usize| view.slice(at..at + (g.rows - 1) * stride + width);
    let gemm = Gemm {
        trans_a: true,
        beta: 1.0,
        lda: Some(g.a_stride),
        ldb: Some(g.b_stride),
        ..Gemm::new(rows, cols, g.rows)
    };
    blas.sgemm(
        &gemm,
        span(g.a, g.a_stride, rows)?,
        span(g.b, g.b_stride, cols)?,
        view.slice(grad..grad + rows * cols)?,
    )
}

/// Items from which a product is host work between launches (see
/// [`PersistentOptions::host_items`]): cuBLAS runs a wide level's product
/// faster than the kernel's tiles (which share the SMs with the held
/// weights), once that saves more than a launch costs; 512 was about the
/// best of the thresholds swept at h 256 and 512
/// (`docs/benchmarks.md#persistent-engine-host-products`).
pub const HOST_PRODUCT_ITEMS: usize = 512;

/// The environment variable that overrides [`HOST_PRODUCT_ITEMS`] (for
/// tuning; see [`PersistentOptions::host_items`]).
pub const HOST_ENV: &str = "RAMUS_VPPS_HOST";

/// The environment variable that overrides [`WIDE_PRODUCT_ITEMS`] (for
/// tuning; see [`PersistentOptions::wide_items`]).
pub const WIDE_ENV: &str = "RAMUS_VPPS_WIDE";

/// The environment variable that, set to `scalar`, builds every kernel
/// with the wide products' scalar epilogue (for tuning and diagnosis; see
/// [`KernelOptions::vector_epilogue`]).
pub const EPILOGUE_ENV: &str = "RAMUS_VPPS_EPILOGUE";

/// The environment variable that turns the persistent kernel's instruction
/// trace on: a file each launch's records are appended to.
pub const TRACE_ENV: &str = "RAMUS_VPPS_TRACE";

/// Appends one launch's trace (`words`: the barrier buffer's records,
/// [`TRACE_WORDS_PER_CTA`] per CTA) to `path` as lines `launch cta opcode
/// arg start_ns end_ns items` (times: the GPU's global timer, low 32 bits;
/// items: a product's item count, 255 for that many or more, else 0).
/// `scripts/vpps_trace.py` summarises a file.
fn append_trace(path: &std::path::Path, launch: u64, words: &[u32]) -> Result<()> {
    use std::fmt::Write as _;
    use std::io::Write as _;
    let mut out = String::new();
    for (cta, rec) in words.chunks(TRACE_WORDS_PER_CTA).enumerate() {
        let count = (rec[0] as usize).min((rec.len() - 1) / TRACE_RECORD_WORDS);
        for r in rec[1..1 + count * TRACE_RECORD_WORDS].chunks(TRACE_RECORD_WORDS) {
            let _ = writeln!(
                out,
                "{launch} {cta} {} {} {} {} {}",
                r[0] & 0xff,
                r[0] >> 16,
                r[1],
                r[2],
                (r[0] >> 8) & 0xff
            );
        }
    }
    let trace_err = |e: std::io::Error| model_err(format!("trace file {}: {e}", path.display()));
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| f.write_all(out.as_bytes()))
        .map_err(trace_err)
}

/// Starts compiling the kernels the `rpw` search's `candidates` may build
/// on threads of their own, so that the search finds each compiled when it
/// gets to it: every candidate's first plan, then each one's first plan
/// with the scalar epilogue, then each one's first fallback (a plan that
/// spills falls back, see [`build_variant`]),
/// as many as the host has cores beside the one preparing batches.
fn prefetch_candidates(
    cache: &KernelCache,
    prog: &PersistentProgram,
    build: &VariantBuild,
    candidates: &[VariantChoice],
) {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let source_of = |request: &PlanRequest, vector_epilogue: bool| {
        plan(&prog.matrices, &build.limits, request).ok().map(|p| {
            let options = build.kernel_options(vector_epilogue);
            (kernel_source(&p, options, &prog.fused_source), p)
        })
    };
    let first_epilogue = build.epilogues()[0];
    let mut sources: Vec<String> = Vec::new();
    let mut scalar: Vec<String> = Vec::new();
    let mut fallbacks: Vec<PlanRequest> = Vec::new();
    for choice in candidates {
        let request = choice.request();
        if let Some((source, p)) = source_of(&request, first_epilogue) {
            fallbacks.extend(choice.fallback(&request, (p.ctas_per_sm, p.grads_in_registers)));
            sources.push(source);
        }
        if first_epilogue {
            scalar.extend(source_of(&request, false).map(|(source, _)| source));
        }
    }
    sources.extend(scalar);
    sources.extend(
        fallbacks
            .iter()
            .filter_map(|r| source_of(r, first_epilogue).map(|(source, _)| source)),
    );
    let mut started = std::collections::HashSet::new();
    for source in sources {
        if started.len() + 1 >= cores {
            break;
        }
        if started.insert(source.clone()) {
            // a compile that cannot start now runs when the variant is built
            let _ = cache.prefetch(&source, &[KERNEL_NAME]);
        }
    }
}

impl VariantBuild {
    /// The kernel's options for its variants, with or without the vector
    /// epilogue ([`KernelOptions::vector_epilogue`]).
    fn kernel_options(&self, vector_epilogue: bool) -> KernelOptions {
        KernelOptions {
            rule: self.rule,
            trace: self.trace.is_some(),
            vector_epilogue,
        }
    }

    /// The epilogues a plan's kernel is tried with, in order.
    fn epilogues(&self) -> &'static [bool] {
        if self.vector_epilogue {
            &[true, false]
        } else {
            &[false]
        }
    }
}

/// The scheduler of a variant with `register_plan`.
fn variant_scheduler(register_plan: &RegisterPlan, build: &VariantBuild) -> Scheduler {
    let mut scheduler = Scheduler::new(register_plan);
    scheduler.record = false;
    // product tasks carry an (input, output, bias) item per row
    scheduler.holder_item = PRODUCT_ITEM_WORDS;
    scheduler.wide_items = (build.wide_items != u32::MAX).then_some(build.wide_items as usize);
    scheduler
}

/// Compiles started before the device is open, where the first choice's
/// kernel is not in the cache: the kernel proper for its first plan, with
/// each epilogue it is tried with (`source`: the first), each on a thread
/// of its own (none where no thread could be started; taken over by the
/// cache once it exists) and, with a bridge wanted and where NVRTC can,
/// the bridge for the plan (its image, and when its compile started).
struct EarlyCompiles {
    plan: RegisterPlan,
    source: String,
    kernel_proper: Vec<(String, Prefetched)>,
    bridge: Option<(Vec<u8>, Instant)>,
}

/// Starts [`EarlyCompiles`] for `choice`'s first plan, unless the plan
/// fails (set-up then builds the variant and reports that) or its kernel
/// is in the cache `directory`; compiles the bridge on this thread (see
/// [`PersistentOptions::bridge`]).
fn start_compiles(
    prog: &PersistentProgram,
    build: &VariantBuild,
    choice: VariantChoice,
    compiler: &NvrtcCompiler,
    directory: Option<&std::path::Path>,
    bridge: bool,
) -> Option<EarlyCompiles> {
    let plan = plan(&prog.matrices, &build.limits, &choice.request()).ok()?;
    let source_with =
        |vector| kernel_source(&plan, build.kernel_options(vector), &prog.fused_source);
    // the bridge's is the scalar epilogue's (no 16-byte atomics in code
    // compiled without optimization, whose pointers stay generic)
    let scalar = source_with(false);
    let sources: Vec<String> = build
        .epilogues()
        .iter()
        .map(|&v| if v { source_with(true) } else { scalar.clone() })
        .collect();
    let source = sources[0].clone();
    if directory.is_some_and(|d| crate::cache::entry_on_disk(d, &compiler.cache_tag(), &source)) {
        return None;
    }
    let kernel_proper = sources
        .into_iter()
        .filter_map(|s| {
            let proper = compiler.clone();
            let compiling =
                compile_in_background(&s, &[KERNEL_NAME], move |s, n| proper.compile(s, n));
            compiling.ok().map(|c| (s, c))
        })
        .collect();
    let bridge = bridge
        .then(|| {
            let compile_started = Instant::now();
            let quick = compiler.clone().with_fast_compile(true);
            // an NVRTC that cannot compile quickly: no bridge
            let image = quick.compile(&scalar, &[KERNEL_NAME]).ok()?;
            Some((image, compile_started))
        })
        .flatten();
    Some(EarlyCompiles {
        plan,
        source,
        kernel_proper,
        bridge,
    })
}

/// Once the device is open: loads the bridge kernel, if one was compiled
/// (it keeps its weights in local memory, which the driver takes for every
/// thread the device holds at its launch: a part of `need`), and asks
/// `check` whether `need` fits the device's room. A refusal waits for the
/// compiles under way first (NVRTC must not be torn down under them at
/// exit).
fn check_opened(
    device: &Arc<CudaDevice>,
    need: &mut ramus_exec::memory::DeviceNeed,
    early: &mut Option<EarlyCompiles>,
    check: DeviceCheck<'_>,
    budget: Option<u64>,
) -> Result<(ramus_exec::memory::Fitted, Option<(LoadedModule, Instant)>)> {
    let bridge = match early.as_mut().and_then(|e| e.bridge.take()) {
        Some((image, at)) => {
            let module = LoadedModule::load(device.context(), &image, &[KERNEL_NAME])?;
            let spilled = module
                .function(KERNEL_NAME)?
                .local_size_bytes()
                .in_call("cuFuncGetAttribute(LOCAL_SIZE_BYTES)")?;
            let spilled = u64::try_from(spilled).unwrap_or(0);
            let local = local_memory_bytes(device, spilled)?;
            need.parts.push(("the bridge kernel's local memory", local));
            Some((module, at))
        }
        None => None,
    };
    match run_check(check, need, device_room(device, budget)?) {
        Ok(fitted) => Ok((fitted, bridge)),
        Err(e) => {
            for (_, compiling) in early.take().into_iter().flat_map(|e| e.kernel_proper) {
                let _ = compiling.join();
            }
            Err(e)
        }
    }
}

/// Plans the registers for `rpw` and compiles (or loads) its kernel.
fn build_variant(
    device: &Arc<CudaDevice>,
    cache: &KernelCache,
    pool: &Arc<DevicePool>,
    prog: &PersistentProgram,
    build: &VariantBuild,
    choice: VariantChoice,
) -> Result<Variant> {
    // The plan budgets registers with a fixed allowance for the
    // interpreter; where the compiled kernel needs more and spills (or
    // cannot be resident) with either epilogue, the choice's fallback is
    // tried (`VariantChoice::fallback`).
    let mut request = choice.request();
    loop {
        let register_plan: RegisterPlan = plan(&prog.matrices, &build.limits, &request)?;
        let chosen = (register_plan.ctas_per_sm, register_plan.grads_in_registers);
        let mut failed = None;
        // the vector epilogue first; where it spills, the scalar one
        for &vector_epilogue in build.epilogues() {
            let built = PersistentKernel::build(
                device,
                cache,
                pool,
                register_plan.clone(),
                build.kernel_options(vector_epilogue),
                &prog.fused_source,
                &build.slots,
            );
            match built {
                Ok(kernel) => {
                    let scheduler = Arc::new(variant_scheduler(kernel.plan(), build));
                    return Ok(Variant { kernel, scheduler });
                }
                Err(e) => failed = Some(e),
            }
        }
        match choice.fallback(&request, chosen) {
            Some(next) => request = next,
            None => {
                return Err(failed.unwrap_or_else(|| model_err("no kernel was built")));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ramus_nn::{build_model_with, ModelConfig, ModelOptions};

    /// Follows `choice`'s fallbacks from its first request (`chosen`: each
    /// failed plan's CTAs per SM and gradients' place) until it gives up.
    fn fallback_chain(
        choice: VariantChoice,
        chosen: &[(usize, bool)],
    ) -> Vec<(Option<usize>, Option<bool>)> {
        let mut request = choice.request();
        let mut chain = Vec::new();
        for &c in chosen {
            match choice.fallback(&request, c) {
                Some(next) => {
                    assert_eq!(next.rpw, choice.rpw);
                    chain.push((next.ctas_per_sm, next.grads_in_registers));
                    request = next;
                }
                None => break,
            }
        }
        chain
    }

    #[test]
    fn kernels_try_the_vector_epilogue_first_unless_told_otherwise() {
        let b = build(None, None);
        assert_eq!(b.epilogues(), [true, false]);
        assert!(b.kernel_options(true).vector_epilogue);
        let scalar = VariantBuild {
            vector_epilogue: false,
            ..b
        };
        assert_eq!(scalar.epilogues(), [false]);
    }

    #[test]
    fn a_failing_plan_falls_back_to_fewer_ctas_then_gradients_outside_registers() {
        let open = VariantChoice::of(&build(None, None), 2);
        // 2 CTAs with register gradients spill, then 1; the gradients go out
        // (the plan takes 2 CTAs again), which spills too, then 1 CTA
        // keeping the gradients out; then nothing is left
        let chain = fallback_chain(open, &[(2, true), (1, true), (2, false), (1, false)]);
        assert_eq!(
            chain,
            [(Some(1), None), (None, Some(false)), (Some(1), Some(false))]
        );
        let kept = VariantChoice {
            keep_ctas: true,
            ..open
        };
        let chain = fallback_chain(kept, &[(2, true), (2, false), (1, false)]);
        assert_eq!(chain, [(Some(2), Some(false)), (Some(1), Some(false))]);
        // fixed by the options: no fallback at all
        let fixed = VariantChoice::of(&build(Some(2), Some(true)), 2);
        assert!(fallback_chain(fixed, &[(2, true)]).is_empty());
    }

    fn build(ctas_per_sm: Option<usize>, grads_in_registers: Option<bool>) -> VariantBuild {
        VariantBuild {
            limits: DeviceLimits::hopper(132),
            ctas_per_sm,
            grads_in_registers,
            rule: UpdateRule::Sgd,
            slots: Vec::new(),
            choice_file: None,
            trace: None,
            wide_items: WIDE_PRODUCT_ITEMS,
            vector_epilogue: true,
        }
    }

    #[test]
    fn the_search_also_tries_each_rpw_with_two_ctas_kept_and_with_gradients_in_memory() {
        let cfg = ModelConfig {
            vocab: 50,
            hidden: 512,
            classes: 5,
        };
        let model = build_model_with("treelstm", &cfg, &ModelOptions::default()).expect("model");
        let prog = PersistentProgram::build(&model).expect("program");
        let open = VariantChoice::candidates(&prog, &build(None, None));
        let rpws = valid_rpws(&prog.matrices, &DeviceLimits::hopper(132));
        assert_eq!(open.len(), 3 * rpws.len().min(TUNE_CANDIDATES));
        for three in open.chunks(3) {
            assert!(three
                .iter()
                .all(|c| c.rpw == three[0].rpw && c.ctas_per_sm.is_none()));
            assert_eq!(
                three
                    .iter()
                    .map(|c| (c.keep_ctas, c.grads_in_registers))
                    .collect::<Vec<_>>(),
                [(false, None), (true, None), (false, Some(false))]
            );
        }
        // a fixed CTA count leaves nothing to keep, but the gradients'
        // place still open
        let c = VariantChoice::candidates(&prog, &build(Some(1), None));
        assert_eq!(c.len(), 2 * rpws.len().min(TUNE_CANDIDATES));
        assert!(
            c.iter().all(|c| !c.keep_ctas && c.ctas_per_sm == Some(1)),
            "{c:?}"
        );
        // a fixed gradients' place leaves one candidate per rpw
        let c = VariantChoice::candidates(&prog, &build(None, Some(false)));
        assert!(c.iter().all(|c| !c.keep_ctas), "{c:?}");
        assert_eq!(c.len(), rpws.len().min(TUNE_CANDIDATES));
    }

    #[test]
    fn a_choice_is_remembered_per_power_of_two_of_batch_size() {
        let key = |b| choice_key("model".to_string(), b);
        // no batch size: the key of earlier versions
        assert_eq!(key(None), "model");
        assert_eq!(key(Some(5)), key(Some(8)));
        assert_eq!(key(Some(0)), key(Some(1)));
        assert_ne!(key(Some(8)), key(Some(9)));
        assert_ne!(key(Some(1)), key(Some(2)));
        assert_ne!(key(Some(128)), key(None));
    }

    #[test]
    fn a_remembered_choice_fixes_the_plan_and_old_files_still_parse() {
        let b = build(None, None);
        assert_eq!(
            VariantChoice::parse("2 2 0\n", &b),
            Some(VariantChoice {
                rpw: 2,
                ctas_per_sm: Some(2),
                grads_in_registers: Some(false),
                keep_ctas: false,
            })
        );
        assert_eq!(
            VariantChoice::parse("3\n", &b),
            Some(VariantChoice::of(&b, 3))
        );
        for bad in ["", "x", "1 2", "1 2 3 4", "-1 1 1"] {
            assert_eq!(VariantChoice::parse(bad, &b), None, "{bad:?}");
        }
    }
}
