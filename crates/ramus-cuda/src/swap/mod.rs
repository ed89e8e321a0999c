//! Training past device memory on CUDA: the mechanism that executes a
//! [`ramus_swap::SwapPlan`] (AutoVM, thesis §3.2, with explicit copies to
//! pinned host memory instead of managed memory, which Ramus never uses).
//!
//! # Where tensors live
//!
//! On the swap path ([`SwapMode`] other than `Off`) a static-graph model
//! (the CNNs: one vertex per image, every step over all images at once) —
//! or a dynamic one (trees, sequences), its function nodes cut into one
//! tensor per segment of the batch's rows in the batched engine's task
//! order (see `steps`' dynamic module) — trains through
//! [`CudaEngine::train_step`](crate::CudaEngine) with
//!
//! * **persistent tensors** — parameters, their gradients, the optimizer's
//!   state — in the engine's own pool buffers, resident for good;
//! * **every other tensor** (each materialized node of the forward and
//!   backward graphs, see the `steps` module) allocated right before the first op
//!   that uses it ("pre-access") and freed right after its last use, or
//!   offloaded. With the planner, at the offset the plan's
//!   [`ramus_swap::Layout`] gives it in one **arena** of the pool, reserved
//!   for the step: the pool's best-fit
//!   [`OffsetAllocator`](crate::OffsetAllocator) fragments under a plan's
//!   traffic (tensors of many sizes coming, going and coming back) until a
//!   large tensor finds no free range although the budget holds it — the
//!   failure a plan made for byte counts alone met on the device. Without a
//!   plan (no swapping, naive swapping), in a pool allocation of its own.
//!   With a budget the pool is one chunk of exactly the budget, so nothing
//!   outside it is ever reserved;
//! * index arrays and the lanes' scratch memory (reserved up front at the
//!   largest size any op asks for) in the batch arena and pool: the fixed
//!   overhead that the planner's budget leaves out;
//! * **offloaded tensors** in a pinned host slot per tensor
//!   (`host::HostSlot`), allocated once and reused every iteration.
//!
//! # Streams and events
//!
//! Ops run in order on the engine's main stream (the compute stream). Each
//! direction has a copy stream of its own. An offload waits for an event
//! recorded on the compute stream after the op that last wrote the tensor,
//! then records the tensor's *offload event*; the tensor's device memory is
//! returned to the pool only once that event has completed (queried as
//! allocations need room, waited for when they must) — with a layout, the
//! next tensor placed there instead makes its first writer (its op on the
//! compute stream, or its prefetch) wait for that event, so the host never
//! blocks for memory. A prefetch waits for
//! an event recorded on the compute stream at its issue point (its
//! destination may be memory that earlier compute freed) and for the
//! tensor's offload event, then records its *prefetch event*; every op that
//! reads the tensor makes the compute stream wait for that event (the host
//! never blocks for a prefetch). The ordering decisions — when to allocate,
//! free, copy and wait — are made by [`ramus_swap::Executor`], shared with
//! the simulated device of the CI tests; the CUDA engine implements its
//! [`ramus_swap::SwapDevice`] trait.
//!
//! # Plans
//!
//! The trace the planner gets ([`training_trace`]) is built from the
//! engine's own op list and tensor sizes, so tensor ids and op indices in a
//! plan are the engine's. With [`SwapMode::Planner`] (or `Auto` when the
//! iteration does not fit), the first iteration of each batch shape runs
//! the earliest-placement plan (Listing 3.4) with CUDA timing events around
//! every op and copy; the plan is then remade with the measured op times
//! and link bandwidths (profiled placement, Listing 3.3) for the following
//! iterations. [`SwapMode::Naive`] swaps on demand instead: when the pool
//! refuses an allocation, the least-recently-used tensors are evicted
//! synchronously; a tensor on the host is fetched back synchronously when
//! an op touches it. Results are bit-identical in every mode: the same
//! kernels run on the same values in the same order.

mod device;
mod host;
mod runtime;
mod step;
pub(crate) mod steps;
mod trainer;

pub(crate) use host::HostSlot;
pub use trainer::SwapTrainer;

use std::fmt;
use std::str::FromStr;

use ramus_core::Model;
use ramus_exec::Batch;
use ramus_exec::OptimizerKind;
use ramus_swap::{
    AutoVmPlanner, CostModel, ExecReport, Layout, NoBudgetPlanner, Planner, PlannerConfig, Policy,
    PrefetchTiming, SwapPlan, TensorKind, Trace,
};
use serde_json::json;

use crate::error::Result;
use crate::program::Program;

/// How the CUDA engine trains under a device memory budget.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum SwapMode {
    /// The plain engine: every tensor of a batch in the batch arena;
    /// exceeding the budget is an error naming the tensor.
    #[default]
    Off,
    /// The swap path without swapping: tensors allocated at first use and
    /// freed after the last (a static-graph step's at the offsets of one
    /// laid-out arena, see [`resident_plan`]); exceeding the budget is an
    /// error naming the op, the tensor and the budget.
    Resident,
    /// Naive on-demand swapping: synchronous least-recently-used eviction
    /// when an allocation fails, synchronous fetch when a tensor is touched.
    Naive,
    /// The AutoVM planner's plan, profiled after the first iteration.
    Planner,
    /// `Planner` if the iteration does not fit the budget, else `Resident`.
    Auto,
}

impl SwapMode {
    /// The name the command line uses.
    pub fn name(self) -> &'static str {
        match self {
            SwapMode::Off => "off",
            SwapMode::Resident => "none",
            SwapMode::Naive => "naive",
            SwapMode::Planner => "planner",
            SwapMode::Auto => "auto",
        }
    }
}

impl fmt::Display for SwapMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for SwapMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "off" => Ok(SwapMode::Off),
            "none" | "resident" => Ok(SwapMode::Resident),
            "naive" => Ok(SwapMode::Naive),
            "planner" => Ok(SwapMode::Planner),
            "auto" => Ok(SwapMode::Auto),
            other => Err(format!(
                "unknown swap mode `{other}` (known: auto, planner, naive, none, off)"
            )),
        }
    }
}

/// Settings of the swap path.
#[derive(Clone, Debug, PartialEq)]
pub struct SwapConfig {
    pub mode: SwapMode,
    /// Planner: tensors smaller than this stay resident (Listing 3.1).
    pub size_threshold_bytes: u64,
    /// Planner: gaps of fewer ops stay resident (Listing 3.1).
    pub min_reuse_ops: usize,
    /// Planner: time the first iteration of each batch shape (CUDA events
    /// around every op and copy) and re-plan with the measured times
    /// (static graphs; a dynamic batch keeps the estimated times).
    pub profile: bool,
    /// Fraction of the budget the planner leaves free as headroom for pool
    /// memory outside the plan that may come after it was made (a larger
    /// batch's index arrays). The plan's own tensors cannot fragment the
    /// pool: they live at fixed offsets of one arena (see
    /// [`ramus_swap::layout`]).
    pub headroom: f64,
    /// Dynamic models: the bytes of a segment's scattered states the
    /// function rows are grouped into (see the `steps::dynamic` module):
    /// consecutive batching tasks are merged until a segment has this many
    /// bytes of state rows, so that its tensors are worth offloading and
    /// the trace stays short enough to plan per batch.
    pub segment_bytes: u64,
}

impl Default for SwapConfig {
    fn default() -> Self {
        SwapConfig {
            mode: SwapMode::Off,
            size_threshold_bytes: 1 << 20,
            min_reuse_ops: 2,
            profile: true,
            headroom: 0.01,
            segment_bytes: 4 << 20,
        }
    }
}

impl SwapConfig {
    /// The defaults with `mode`.
    pub fn with_mode(mode: SwapMode) -> SwapConfig {
        SwapConfig {
            mode,
            ..SwapConfig::default()
        }
    }
}

/// Rows per segment of a dynamic model under `config`: enough rows for
/// [`SwapConfig::segment_bytes`] of scattered state (at least one).
pub fn segment_rows(model: &Model, config: &SwapConfig) -> usize {
    let row_bytes = 4 * model.state_width.max(1) as u64;
    usize::try_from(config.segment_bytes.div_ceil(row_bytes))
        .unwrap_or(usize::MAX)
        .max(1)
}

/// What the last swap-path training step did.
#[derive(Clone, Debug, PartialEq)]
pub struct SwapStepReport {
    /// The mode asked for.
    pub mode: SwapMode,
    /// The policy that ran (`Auto` resolved; `None` for no swapping).
    pub policy: Option<Policy>,
    /// Ops and tensors of the iteration.
    pub ops: usize,
    pub tensors: usize,
    /// The pool's budget (`None`: unlimited).
    pub device_budget: Option<u64>,
    /// Pool memory outside the trace's tensors (arena, workspace, optimizer
    /// extras), measured before the iteration.
    pub overhead_bytes: u64,
    /// The budget the plan was made for (device budget less the overhead
    /// and the headroom).
    pub plan_budget: Option<u64>,
    /// Peak of the iteration's tensors without swapping.
    pub trace_peak_bytes: u64,
    /// Whether this iteration was timed to re-plan.
    pub profiled: bool,
    /// The arena the plan's layout places the tensors in (`None`: no plan
    /// or no layout).
    pub arena_bytes: Option<u64>,
    /// What the executor did.
    pub exec: ExecReport,
    /// The pool's peak in-use bytes so far.
    pub pool_peak_bytes: u64,
    /// Segments a dynamic model's rows were cut into (0: a static-graph
    /// model).
    pub segments: usize,
    /// Seconds this step spent planning (`None`: it reused the plan of an
    /// earlier batch of the same structure).
    pub plan_seconds: Option<f64>,
}

impl fmt::Display for SwapStepReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use ramus_swap::human_bytes;
        let e = &self.exec;
        write!(
            f,
            "swap {}: {}; {} ops, {} tensors, their peak {}",
            self.mode,
            self.policy.map_or("no swapping", |p| p.label()),
            self.ops,
            self.tensors,
            human_bytes(self.trace_peak_bytes)
        )?;
        if let Some(b) = self.device_budget {
            write!(f, ", budget {}", human_bytes(b))?;
        }
        if let Some(b) = self.plan_budget {
            write!(f, " ({} for them)", human_bytes(b))?;
        }
        write!(
            f,
            "; per step {} to the host in {} copies, {} back in {}",
            human_bytes(e.bytes_to_host),
            e.copies_to_host,
            human_bytes(e.bytes_to_device),
            e.copies_to_device
        )?;
        if e.fallback_evictions > 0 {
            write!(f, ", {} fallback evictions", e.fallback_evictions)?;
        }
        if let Some(a) = self.arena_bytes {
            write!(f, "; arena {}", human_bytes(a))?;
            if e.reuses_after_offload > 0 {
                write!(
                    f,
                    " ({} reuses ordered after an offload)",
                    e.reuses_after_offload
                )?;
            }
        }
        if self.segments > 0 {
            write!(f, "; {} segments", self.segments)?;
        }
        if let Some(s) = self.plan_seconds {
            write!(f, "; planned in {}", ramus_swap::human_seconds(s))?;
        }
        write!(f, "; pool peak {}", human_bytes(self.pool_peak_bytes))
    }
}

impl SwapStepReport {
    /// The report as JSON (for benchmarks).
    pub fn to_json(&self) -> serde_json::Value {
        json!({
            "mode": self.mode.name(),
            "policy": self.policy.map(|p| p.label()),
            "ops": self.ops,
            "tensors": self.tensors,
            "device_budget": self.device_budget,
            "overhead_bytes": self.overhead_bytes,
            "plan_budget": self.plan_budget,
            "trace_peak_bytes": self.trace_peak_bytes,
            "profiled": self.profiled,
            "arena_bytes": self.arena_bytes,
            "exec": serde_json::to_value(&self.exec).unwrap_or_default(),
            "pool_peak_bytes": self.pool_peak_bytes,
            "segments": self.segments,
            "plan_seconds": self.plan_seconds,
        })
    }
}

/// The training iteration of static-graph `model` on `batch` as the CUDA
/// swap path runs it, built without a device: the trace a planner reads
/// (parameters, their gradients and `optimizer`'s state persistent; every
/// other tensor a node buffer of the engine, sized as the pool allocates
/// it). `conv_workspace` is the engine's cap on convolution columns
/// (`None`: the default); it does not change the trace.
pub fn training_trace(
    model: &Model,
    batch: &Batch<'_>,
    optimizer: OptimizerKind,
    conv_workspace: Option<usize>,
) -> Result<Trace> {
    Ok(training_iteration(model, batch, optimizer, conv_workspace)?.trace)
}

/// A training iteration of the swap path, built without a device: its
/// trace and the pool memory it needs outside the trace's tensors.
#[derive(Clone, Debug)]
pub struct SwapIteration {
    /// The ops and tensors (see [`training_trace`]).
    pub trace: Trace,
    /// Bytes of the lane's scratch memory (convolution columns), reserved
    /// in the pool up front at the largest size any op asks for.
    pub scratch_bytes: u64,
    /// Per op of the trace, its estimated work: (floating-point
    /// operations, bytes moved), from the op registry's cost model.
    pub op_costs: Vec<(f64, f64)>,
    /// Segments of a dynamic model's rows (0: a static-graph model).
    pub segments: usize,
}

/// How fast a GPU runs an iteration's ops: a roofline for estimates before
/// an iteration was profiled.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OpSpeed {
    /// Floating-point operations per second (fp32, im2col GEMMs included).
    pub flops_per_s: f64,
    /// Device memory bytes per second.
    pub bytes_per_s: f64,
    /// Fixed cost of one op (launches), seconds.
    pub launch_s: f64,
}

impl OpSpeed {
    /// An H100 in fp32 without tensor cores, as the swap path's kernels
    /// reach it: 25 Tflop/s, 2 TB/s, 10 µs per op.
    pub fn h100_fp32() -> OpSpeed {
        OpSpeed {
            flops_per_s: 25e12,
            bytes_per_s: 2e12,
            launch_s: 10e-6,
        }
    }

    /// Per op, its estimated duration: the slower of its arithmetic and
    /// its memory traffic, plus the launch cost.
    pub fn durations(&self, costs: &[(f64, f64)]) -> Vec<f64> {
        costs
            .iter()
            .map(|&(flops, bytes)| {
                (flops / self.flops_per_s).max(bytes / self.bytes_per_s) + self.launch_s
            })
            .collect()
    }

    /// The same speed scaled so that the iteration of `costs` takes
    /// `step_s` (a measured step time).
    pub fn calibrated(&self, costs: &[(f64, f64)], step_s: f64) -> OpSpeed {
        let estimated: f64 = self.durations(costs).iter().sum();
        let launches = self.launch_s * costs.len() as f64;
        let scale = if step_s > launches && estimated > launches {
            (estimated - launches) / (step_s - launches)
        } else {
            1.0
        };
        OpSpeed {
            flops_per_s: self.flops_per_s * scale,
            bytes_per_s: self.bytes_per_s * scale,
            launch_s: self.launch_s,
        }
    }
}

/// [`training_trace`] with the scratch memory the iteration reserves.
pub fn training_iteration(
    model: &Model,
    batch: &Batch<'_>,
    optimizer: OptimizerKind,
    conv_workspace: Option<usize>,
) -> Result<SwapIteration> {
    training_iteration_with(
        model,
        batch,
        optimizer,
        conv_workspace,
        &SwapConfig::default(),
    )
}

/// The training iteration of `model` on `batch` as the swap path runs it
/// under `config`: one tensor per node for a static-graph model; for a
/// dynamic model (trees, sequences) one per node and segment of the
/// batch's rows, its ops in the batched engine's task order (see
/// the `steps::dynamic` module), cut by [`SwapConfig::segment_bytes`].
pub fn training_iteration_with(
    model: &Model,
    batch: &Batch<'_>,
    optimizer: OptimizerKind,
    conv_workspace: Option<usize>,
    config: &SwapConfig,
) -> Result<SwapIteration> {
    let (program, _) = Program::plan(model)?;
    let kind = steps::Kind::Train {
        states: steps::optimizer_states(optimizer),
    };
    let workspace = conv_workspace.unwrap_or(crate::engine::CONV_WORKSPACE_FLOATS);
    let prog = if steps::check_static(model, &program).is_ok() {
        let shape = steps::Shape::of(model, &batch.schedule, model.head.rows);
        steps::build(model, &program, &shape, kind, workspace)?
    } else {
        steps::build_dynamic(
            model,
            &program,
            &batch.schedule,
            model.head.rows,
            kind,
            workspace,
            segment_rows(model, config),
        )?
    };
    Ok(SwapIteration {
        op_costs: prog.costs,
        scratch_bytes: crate::offset_allocator::aligned_size(
            4 * prog.workspace_floats.max(1) as u64,
        )
        .unwrap_or(u64::MAX),
        segments: prog.segments.len(),
        trace: prog.trace,
    })
}

/// The bytes a plan may give the iteration's tensors under a device budget:
/// the budget less the fixed overhead (memory in use outside the trace's
/// tensors) and [`SwapConfig::headroom`].
pub fn plan_budget(device_budget: u64, overhead: u64, config: &SwapConfig) -> u64 {
    let reserve = (device_budget as f64 * config.headroom.clamp(0.0, 0.5)) as u64;
    device_budget
        .saturating_sub(overhead)
        .saturating_sub(reserve)
}

/// Plans a training iteration the way the swap path does: the AutoVM
/// planner under `budget` (see [`plan_budget`]) with `config`'s thresholds,
/// activations and gradients offloadable (parameters, their gradients and
/// optimizer state stay resident), every allocation placed at an offset of
/// one arena (a [`ramus_swap::Layout`]: the pool's best fit fragments
/// under a plan's traffic), `cost` for the link and `timing` for the
/// prefetches ([`PrefetchTiming::Earliest`] for the first iteration of a
/// batch shape, [`PrefetchTiming::Profiled`] once its op times are
/// measured).
pub fn plan_training(
    trace: &Trace,
    budget: u64,
    config: &SwapConfig,
    cost: CostModel,
    timing: PrefetchTiming,
) -> std::result::Result<SwapPlan, ramus_swap::PlanError> {
    let mut c = PlannerConfig::new(budget);
    c.size_threshold_bytes = config.size_threshold_bytes;
    c.min_reuse_ops = config.min_reuse_ops;
    c.offload_kinds = vec![TensorKind::Activation, TensorKind::Gradient];
    c.cost = cost;
    c.timing = timing;
    c.layout = true;
    AutoVmPlanner::new(c).plan(trace)
}

/// The no-swap mode's memory for a training iteration: a plan with no
/// actions whose every allocation has a fixed offset in one arena (its
/// [`ramus_swap::Layout`]), so that the pool's best fit, cutting tensor
/// after tensor from one budget-sized chunk, cannot fragment an iteration
/// whose bytes fit. The arena needs `layout.arena_bytes` besides the
/// persistent tensors.
pub fn resident_plan(trace: &Trace, cost: CostModel) -> std::result::Result<SwapPlan, String> {
    let mut plan = NoBudgetPlanner::new(cost)
        .plan(trace)
        .map_err(|e| e.to_string())?;
    plan.layout = Some(Layout::of(trace, &plan, None, 1.0).map_err(|e| e.to_string())?);
    Ok(plan)
}
