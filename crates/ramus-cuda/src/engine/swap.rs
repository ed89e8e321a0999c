//! The CUDA engine's swap path (see [`crate::swap`] for the design): a
//! training step of a static-graph model, or of a dynamic one cut into
//! segments (cached by the batch's structure), run op by op by the
//! [`ramus_swap::Executor`], with [`CudaSwapDevice`] carrying out its
//! orders — per-tensor pool memory, pinned host slots, one copy stream per
//! direction and events ordering the copies against the compute stream.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaStream};

use ramus_core::{HeadRows, Model, Params};
use ramus_exec::{fill_dropout_mask, Batch, ForwardOutput, Mode};
use ramus_exec::{OptimizerConfig, StepOutcome};
use ramus_swap::{
    analyze, CostModel, ExecOptions, Executor, Policy, PrefetchTiming, SwapPlan, TensorId,
};

use super::{Buf, CudaEngine};
use crate::error::{CudaError, InCall, Result};
use crate::pinned::PinnedBuffer;
use crate::pool::{DeviceView, PoolBuffer};
use crate::swap::steps::{self, Kind, Shape, SwapOp, SwapProgram};
use crate::swap::{HostSlot, SwapConfig, SwapMode, SwapStepReport};

mod device;
use device::CudaSwapDevice;

/// A tensor's device memory.
enum Mem {
    Floats(PoolBuffer<f32>),
    Indices(PoolBuffer<u32>),
    /// A range of the step's arena (a plan with a layout): valid while the
    /// arena is held, which is until the executor has drained every copy.
    Placed(Buf),
}

impl Mem {
    fn buf(&self) -> Buf {
        match self {
            Mem::Floats(b) => Buf::Floats(b.view()),
            Mem::Indices(b) => Buf::Indices(b.view()),
            Mem::Placed(b) => *b,
        }
    }

    /// Device address and bytes of the tensor's elements.
    fn raw(&self) -> (u64, usize) {
        match self.buf() {
            Buf::Floats(v) => (v.device_ptr(), v.byte_len()),
            Buf::Indices(v) => (v.device_ptr(), v.byte_len()),
            Buf::Absent => (0, 0),
        }
    }
}

/// Per trace tensor: device memory, host slot and the events of its copies.
#[derive(Default)]
struct Slot {
    mem: Option<Mem>,
    host: Option<HostSlot>,
    offloaded: Option<CudaEvent>,
    prefetched: Option<CudaEvent>,
    /// Layout mode: tensors whose offload may still read this tensor's
    /// (just placed) memory; its first write waits for their events.
    write_after: Vec<TensorId>,
}

/// How a prepared batch shape is executed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Mode, budget and plan not decided yet.
    New,
    /// Planned without op times; the next iteration is timed.
    Profile,
    /// Settled.
    Ready,
}

/// The iteration of one batch shape, and how it runs.
struct Prepared {
    program: SwapProgram,
    stage: Stage,
    policy: Option<Policy>,
    plan: Option<SwapPlan>,
    options: ExecOptions,
    overhead: u64,
    plan_budget: Option<u64>,
    trace_peak: u64,
    /// Seconds the last planning of this iteration took (deciding the mode
    /// and making the plan), and whether the step in progress made it.
    plan_seconds: f64,
    planned_now: bool,
}

/// What a prepared iteration is cached by: a static-graph model's batch
/// shape, or a fingerprint of a dynamic batch's ops and tensors.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum PrepKey {
    Static(Shape, Kind),
    Dynamic(u64, Kind),
}

/// Dynamic batch structures whose plans are kept at most.
const MAX_DYNAMIC_PLANS: usize = 64;

/// The no-swap mode's laid-out plan ([`crate::swap::resident_plan`]) for a
/// static-graph step (a dynamic batch would pay the packing every batch),
/// where its arena fits `room` (the largest free block plus the persistent
/// tensors). Otherwise `None`: tensors are allocated one by one, so that an
/// iteration over the budget fails naming the op, the tensor and the budget.
fn resident_layout(
    program: &SwapProgram,
    room: Option<u64>,
    cost: CostModel,
) -> Result<Option<SwapPlan>> {
    if !program.segments.is_empty() {
        return Ok(None);
    }
    let plan = crate::swap::resident_plan(&program.trace, cost)
        .map_err(|e| swap_err(format!("no-swap layout: {e}")))?;
    let arena = plan.layout.as_ref().map_or(0, |l| l.arena_bytes);
    let needed = program.trace.persistent_bytes().saturating_add(arena);
    Ok((room.is_none_or(|r| needed <= r)).then_some(plan))
}

/// Timing events of a profiled iteration.
#[derive(Default)]
struct Profile {
    ops: Vec<Option<(CudaEvent, CudaEvent)>>,
    /// (to the host?, bytes, start, end)
    copies: Vec<(bool, usize, CudaEvent, CudaEvent)>,
}

/// The swap path's state, kept across steps.
pub(crate) struct SwapRuntime {
    config: SwapConfig,
    d2h: Arc<CudaStream>,
    h2d: Arc<CudaStream>,
    /// Recorded on the compute stream when a copy must follow it.
    mark: CudaEvent,
    /// Ops queued on the compute stream so far, and when `mark` was recorded.
    epoch: u64,
    mark_epoch: Option<u64>,
    slots: Vec<Slot>,
    prepared: HashMap<PrepKey, Prepared>,
    upload: PinnedBuffer,
    loss: PinnedBuffer,
    logits: PinnedBuffer,
    /// Floats of scores the last iteration copied into `logits`.
    logits_len: usize,
    workspace: Option<PoolBuffer<f32>>,
    /// Layout mode: the arena of the step in progress.
    arena: Option<PoolBuffer<f32>>,
    report: Option<SwapStepReport>,
}

impl SwapRuntime {
    pub(crate) fn new(
        engine_device: &crate::device::CudaDevice,
        config: SwapConfig,
    ) -> Result<Self> {
        Ok(SwapRuntime {
            config,
            d2h: engine_device.new_stream()?,
            h2d: engine_device.new_stream()?,
            mark: engine_device.new_event()?,
            epoch: 0,
            mark_epoch: None,
            slots: Vec::new(),
            prepared: HashMap::new(),
            upload: PinnedBuffer::new(engine_device)?,
            loss: PinnedBuffer::new(engine_device)?,
            logits: PinnedBuffer::new(engine_device)?,
            logits_len: 0,
            workspace: None,
            arena: None,
            report: None,
        })
    }

    /// A host slot of at least `bytes` for tensor `t`.
    fn ensure_host(
        &mut self,
        t: usize,
        bytes: usize,
        device: &crate::device::CudaDevice,
    ) -> Result<()> {
        if self.slots.len() <= t {
            self.slots.resize_with(t + 1, Slot::default);
        }
        match &self.slots[t].host {
            Some(h) if h.bytes() >= bytes => return Ok(()),
            Some(_) => {
                // a smaller slot (another batch shape's tensor) may still be
                // used by a copy: drain before freeing it
                self.drain()?;
                self.slots[t].host = None;
            }
            None => {}
        }
        self.slots[t].host = Some(HostSlot::new(device, bytes)?);
        Ok(())
    }

    pub(crate) fn config(&self) -> &SwapConfig {
        &self.config
    }

    /// Puts a prepared iteration back in the cache, forgetting the
    /// dynamic ones when there are too many (each batch of trees may have
    /// a structure of its own).
    fn keep(&mut self, key: PrepKey, prep: Prepared) {
        if matches!(key, PrepKey::Dynamic(..)) && !self.prepared.contains_key(&key) {
            let dynamic = self
                .prepared
                .keys()
                .filter(|k| matches!(k, PrepKey::Dynamic(..)))
                .count();
            if dynamic >= MAX_DYNAMIC_PLANS {
                self.prepared
                    .retain(|k, _| !matches!(k, PrepKey::Dynamic(..)));
            }
        }
        self.prepared.insert(key, prep);
    }

    pub(crate) fn last_report(&self) -> Option<&SwapStepReport> {
        self.report.as_ref()
    }

    /// Drains both copy streams (before host slots may be freed or device
    /// memory dropped after a failed step).
    fn drain(&self) -> Result<()> {
        self.d2h.synchronize().in_call("cuStreamSynchronize")?;
        self.h2d.synchronize().in_call("cuStreamSynchronize")
    }
}

impl Drop for SwapRuntime {
    fn drop(&mut self) {
        if let Err(e) = self.drain() {
            // a copy may still use the host slots: leak them rather than free
            eprintln!("ramus-cuda: leaking swap host slots after a failed drain: {e}");
            for slot in self.slots.drain(..) {
                std::mem::forget(slot);
            }
        }
    }
}

fn swap_err(message: impl Into<String>) -> CudaError {
    CudaError::Model(message.into())
}

impl CudaEngine {
    /// What the last swap-path training step did (`None` off the swap path
    /// or before the first step).
    pub fn last_swap_report(&self) -> Option<&SwapStepReport> {
        self.swap.as_ref().and_then(|rt| rt.last_report())
    }

    /// The swap path's settings (`None`: the plain engine).
    pub fn swap_config(&self) -> Option<&SwapConfig> {
        self.swap.as_ref().map(|rt| rt.config())
    }

    /// The trace and plan the swap path uses for `batch` (planning it if
    /// this batch shape was not run yet; a profiled plan appears after the
    /// first step of the shape).
    pub fn swap_plan(
        &self,
        model: &Model,
        batch: &Batch<'_>,
    ) -> Option<(ramus_swap::Trace, Option<SwapPlan>)> {
        let rt = self.swap.as_ref()?;
        let states = self
            .optimizer
            .as_ref()
            .map_or(0, |(_, o)| steps::optimizer_states(o.config().kind));
        let kind = Kind::Train { states };
        let (key, _) = self
            .program_for(rt, model, &batch.schedule, model.head.rows, kind)
            .ok()?;
        let prep = rt.prepared.get(&key)?;
        Some((prep.program.trace.clone(), prep.plan.clone()))
    }

    /// The cache key of `kind`'s iteration on batch `s`, with the program
    /// already built for a dynamic model (whose key is its fingerprint).
    fn program_for(
        &self,
        rt: &SwapRuntime,
        model: &Model,
        s: &ramus_graph::Schedule,
        rows: HeadRows,
        kind: Kind,
    ) -> Result<(PrepKey, Option<SwapProgram>)> {
        if steps::check_static(model, &self.program).is_ok() {
            return Ok((PrepKey::Static(Shape::of(model, s, rows), kind), None));
        }
        let program = steps::build_dynamic(
            model,
            &self.program,
            s,
            rows,
            kind,
            self.conv_workspace,
            crate::swap::segment_rows(model, &rt.config),
        )?;
        Ok((PrepKey::Dynamic(program.fingerprint(), kind), Some(program)))
    }

    /// One training step on the swap path: forward, backward and the fused
    /// optimizer update, op by op under the executor.
    pub(super) fn swap_train_step(
        &mut self,
        model: &Model,
        params: &mut Params<f32>,
        config: &OptimizerConfig,
        batch: &Batch<'_>,
    ) -> Result<Option<StepOutcome>> {
        self.check_model(model)?;
        let mut rt = self
            .swap
            .take()
            .ok_or_else(|| swap_err("the swap path is not set up"))?;
        self.track_running_stats = true;
        let result = self.swap_step(&mut rt, model, params, config, batch);
        self.track_running_stats = false;
        if result.is_err() {
            self.abandon(&mut rt);
        }
        self.swap = Some(rt);
        result
    }

    fn swap_step(
        &mut self,
        rt: &mut SwapRuntime,
        model: &Model,
        params: &mut Params<f32>,
        config: &OptimizerConfig,
        batch: &Batch<'_>,
    ) -> Result<Option<StepOutcome>> {
        let s = &batch.schedule;
        self.begin_swap_step(model, params)?;
        self.inference_pass = false;
        self.upload_indices(model, s, Mode::Train, model.head.rows)?;
        // the optimizer's state is part of the fixed memory: allocate it
        // first; a skipped step puts back the running statistics
        self.keep_buffers(model, config)?;
        let kind = Kind::Train {
            states: steps::optimizer_states(config.kind),
        };
        let (key, fresh) = self.program_for(rt, model, s, model.head.rows, kind)?;
        let mut prep = self.prepared(rt, model, &key, fresh)?;
        let result = self.swap_run(rt, &mut prep, model, Some(config), batch);
        rt.keep(key, prep);
        let (loss, _) = result?;
        // the step before's status came back before this step's loss
        let previous = self.settle_step()?;
        self.step_submitted(params, loss);
        Ok(previous)
    }

    /// The prepared iteration for `key`, taken out of the runtime's cache
    /// (built if new; the caller puts it back). A dynamic batch brings its
    /// `fresh` program: a cached one of the same structure keeps its plan
    /// and takes the new batch's index words.
    fn prepared(
        &self,
        rt: &mut SwapRuntime,
        model: &Model,
        key: &PrepKey,
        fresh: Option<SwapProgram>,
    ) -> Result<Prepared> {
        let program = match (rt.prepared.remove(key), fresh, key) {
            (Some(mut p), Some(fresh), _) if p.program.same_structure(&fresh) => {
                p.program.indices = fresh.indices;
                p.planned_now = false;
                return Ok(p);
            }
            (Some(mut p), None, _) => {
                p.planned_now = false;
                return Ok(p);
            }
            (_, Some(fresh), _) => fresh,
            (_, None, PrepKey::Static(shape, kind)) => {
                steps::build(model, &self.program, shape, *kind, self.conv_workspace)?
            }
            (_, None, PrepKey::Dynamic(..)) => {
                return Err(swap_err("swap path: a dynamic batch without its program"))
            }
        };
        Ok(Prepared {
            program,
            stage: Stage::New,
            policy: None,
            plan: None,
            options: ExecOptions::resident(None),
            overhead: 0,
            plan_budget: None,
            trace_peak: 0,
            plan_seconds: 0.0,
            planned_now: false,
        })
    }

    /// The forward pass of a static-graph model on the swap path (evaluation
    /// and inference): op by op, each tensor freed after its last use, so
    /// batches whose activations all together exceed the budget still run.
    pub(super) fn swap_forward(
        &mut self,
        model: &Model,
        params: &Params<f32>,
        batch: &Batch<'_>,
        mode: Mode,
        rows: HeadRows,
    ) -> Result<ForwardOutput<f32>> {
        self.check_model(model)?;
        let mut rt = self
            .swap
            .take()
            .ok_or_else(|| swap_err("the swap path is not set up"))?;
        let result = self.swap_forward_in(&mut rt, model, params, batch, mode, rows);
        if result.is_err() {
            self.abandon(&mut rt);
        }
        self.swap = Some(rt);
        result
    }

    fn swap_forward_in(
        &mut self,
        rt: &mut SwapRuntime,
        model: &Model,
        params: &Params<f32>,
        batch: &Batch<'_>,
        mode: Mode,
        rows: HeadRows,
    ) -> Result<ForwardOutput<f32>> {
        let s = &batch.schedule;
        self.begin_swap_step(model, params)?;
        self.inference_pass = mode != Mode::Train;
        self.upload_indices(model, s, mode, rows)?;
        let kind = if mode == Mode::Infer {
            Kind::Infer
        } else {
            Kind::Evaluate
        };
        let (key, fresh) = self.program_for(rt, model, s, rows, kind)?;
        let mut prep = self.prepared(rt, model, &key, fresh)?;
        let result = self.swap_run(rt, &mut prep, model, None, batch);
        rt.keep(key, prep);
        let (loss, logits) = result?;
        let classes = model
            .head
            .logits
            .map_or(0, |l| model.head.forward.nodes[l].ty.width());
        Ok(ForwardOutput {
            loss: (mode != Mode::Infer).then_some(loss),
            head_vertices: self.state.head_vertices.clone(),
            logits,
            classes,
        })
    }

    /// Resets the per-batch state shared with the plain path and uploads
    /// the parameters if they changed.
    fn begin_swap_step(&mut self, model: &Model, params: &Params<f32>) -> Result<()> {
        self.state.forward_done = false;
        {
            let mut arena = self.arena.borrow_mut();
            arena.reset()?;
            // an evaluation pass may have grown it: the swap path's tensors
            // need that room (earlier work is ordered on the compute stream)
            arena.trim();
        }
        self.main.workspace.set(None);
        self.eager.workspace.set(None);
        self.sync_params(model, params)
    }

    /// After a failed step: leaves no copy in flight and no tensor allocated.
    fn abandon(&self, rt: &mut SwapRuntime) {
        let drained = self.device.synchronize().and_then(|()| rt.drain());
        for slot in &mut rt.slots {
            slot.mem = None;
            slot.write_after.clear();
        }
        if drained.is_ok() {
            rt.arena = None;
        } else if let Some(arena) = rt.arena.take() {
            // a copy may still use it: leak it rather than reuse it
            std::mem::forget(arena);
        }
        if let Err(e) = drained {
            eprintln!("ramus-cuda: swap path: could not drain after a failed step: {e}");
        }
    }

    /// Runs the prepared iteration; returns the loss (NaN if none) and the
    /// scores (if copied).
    fn swap_run(
        &mut self,
        rt: &mut SwapRuntime,
        prep: &mut Prepared,
        model: &Model,
        config: Option<&OptimizerConfig>,
        batch: &Batch<'_>,
    ) -> Result<(f64, Vec<f32>)> {
        let nt = prep.program.trace.num_tensors();
        if rt.slots.len() < nt {
            rt.slots.resize_with(nt, Slot::default);
        }
        // the lane's scratch memory, reserved up front at its largest
        let ws_len = prep.program.workspace_floats;
        if rt.workspace.as_ref().is_none_or(|w| w.len() < ws_len) {
            rt.workspace = None;
            rt.workspace = Some(self.pool.alloc::<f32>(ws_len.max(1))?);
        }
        if let Some(w) = &rt.workspace {
            self.main.workspace.set(Some(w.view()));
        }
        // dropout masks, drawn in the plain engine's order
        let mut masks = Vec::with_capacity(prep.program.masks.len());
        for &(_, _, len, rate) in &prep.program.masks {
            let mut mask = vec![0f32; len];
            fill_dropout_mask(&mut mask, rate, true, &mut self.rng);
            masks.push(mask);
        }
        if prep.stage == Stage::New {
            let started = std::time::Instant::now();
            self.decide(rt, prep)?;
            prep.plan_seconds = started.elapsed().as_secs_f64();
            prep.planned_now = true;
        }
        // the index words of a dynamic batch's moves
        let move_indices = if prep.program.indices.is_empty() {
            None
        } else {
            let words = &prep.program.indices;
            let view = self.arena_alloc::<u32>(words.len(), &|| {
                "the index words of the swap path's row moves".into()
            })?;
            let stream = self.device.stream().clone();
            self.staging.upload_slice(words, view, &stream)?;
            self.launcher.count();
            Some(view)
        };
        // the embedding rows the batch touches (the optimizer updates only
        // those), uploaded with the index words before any op runs
        let touched: Vec<DeviceView<u32>> = if config.is_some() {
            self.touched_rows(model, &batch.schedule)?
                .into_iter()
                .map(|(_, rows)| rows)
                .collect()
        } else {
            Vec::new()
        };
        // pinned slots of the planned offloads, before the timed work starts
        if let Some(plan) = &prep.plan {
            for a in &plan.actions {
                if let Some(home) = prep
                    .program
                    .homes
                    .get(a.tensor().index())
                    .copied()
                    .flatten()
                {
                    rt.ensure_host(a.tensor().index(), home.len * 4, &self.device)?;
                }
            }
        }
        let profiling = prep.stage == Stage::Profile;
        let executor = Executor::new(
            &prep.program.trace,
            prep.plan.as_ref(),
            prep.options.clone(),
        )?;
        let mut profile = profiling.then(Profile::default);
        let exec = {
            let mut dev = CudaSwapDevice {
                engine: self,
                rt: &mut *rt,
                program: &prep.program,
                move_indices,
                touched,
                model,
                config,
                batch,
                bufs: Vec::new(),
                masks,
                profile: profile.as_mut(),
            };
            dev.init_bufs()?;
            executor.run(&mut dev)?
        };
        let has = |op: SwapOp| prep.program.ops.contains(&op);
        let loss = if has(SwapOp::ReadLoss) {
            f64::from(rt.loss.host::<f32>(1)?.first().copied().unwrap_or(f32::NAN))
        } else {
            f64::NAN
        };
        let logits = if has(SwapOp::ReadLogits) {
            rt.logits.host::<f32>(rt.logits_len)?.to_vec()
        } else {
            Vec::new()
        };
        // the arena this step used (re-planning may change it)
        let arena_bytes = prep
            .plan
            .as_ref()
            .and_then(|p| p.layout.as_ref())
            .map(|l| l.arena_bytes);
        if let Some(profile) = profile {
            self.replan(rt, prep, &profile)?;
        }
        rt.report = Some(SwapStepReport {
            mode: rt.config.mode,
            policy: prep.policy,
            ops: prep.program.trace.num_ops(),
            tensors: nt,
            device_budget: self.pool.max_bytes(),
            overhead_bytes: prep.overhead,
            plan_budget: prep.plan_budget,
            trace_peak_bytes: prep.trace_peak,
            profiled: profiling,
            arena_bytes,
            exec,
            pool_peak_bytes: self.pool.stats().peak_in_use_bytes,
            segments: prep.program.segments.len(),
            plan_seconds: prep.planned_now.then_some(prep.plan_seconds),
        });
        Ok((loss, logits))
    }

    /// Decides the mode, budget and first plan of a batch shape, from the
    /// memory in use now (everything but the iteration's tensors).
    fn decide(&self, rt: &SwapRuntime, prep: &mut Prepared) -> Result<()> {
        let trace = &prep.program.trace;
        let in_use = self.pool.stats().in_use_bytes;
        prep.overhead = in_use.saturating_sub(trace.persistent_bytes());
        let cost = CostModel::pcie5_x16();
        prep.trace_peak = analyze(trace, &cost).peak_bytes;
        let device_budget = self.pool.max_bytes();
        // the plan's arena is one block of the pool: no more than its
        // largest free range
        let persistent = trace.persistent_bytes();
        let room = self
            .pool
            .largest_free_block()
            .map(|l| persistent.saturating_add(l));
        prep.plan_budget = device_budget.map(|b| {
            let planned = crate::swap::plan_budget(b, prep.overhead, &rt.config);
            room.map_or(planned, |r| planned.min(r))
        });
        if !matches!(prep.program.kind, Kind::Train { .. }) {
            // a forward pass frees as it goes; should it still not fit,
            // naive swapping (unless no swapping was asked for)
            prep.stage = Stage::Ready;
            if rt.config.mode == SwapMode::Resident {
                prep.policy = None;
                prep.options = ExecOptions::resident(None);
            } else {
                prep.policy = Some(Policy::Lru);
                prep.options = ExecOptions::on_demand(None);
            }
            return Ok(());
        }
        let mode = match rt.config.mode {
            SwapMode::Auto => match prep.plan_budget {
                Some(b) if prep.trace_peak > b => SwapMode::Planner,
                _ => SwapMode::Resident,
            },
            m => m,
        };
        match mode {
            SwapMode::Off | SwapMode::Auto | SwapMode::Resident => {
                prep.policy = None;
                prep.options = ExecOptions::resident(None);
                prep.plan = resident_layout(&prep.program, room, cost)?;
                prep.stage = Stage::Ready;
            }
            SwapMode::Naive => {
                prep.policy = Some(Policy::Lru);
                prep.options = ExecOptions::on_demand(None);
                prep.stage = Stage::Ready;
            }
            SwapMode::Planner => {
                let budget = prep.plan_budget.ok_or_else(|| {
                    swap_err(
                        "the swap planner needs a device memory budget \
                         (--device-memory-budget, or PoolConfig::max_bytes)",
                    )
                })?;
                // op times estimated until the profiled iteration measures
                // them: the replay behind the layout needs a time scale
                let estimated = trace
                    .with_durations(
                        &crate::swap::OpSpeed::h100_fp32().durations(&prep.program.costs),
                    )
                    .map_err(|e| swap_err(format!("swap planner: {e}")))?;
                let plan = crate::swap::plan_training(
                    &estimated,
                    budget,
                    &rt.config,
                    cost,
                    PrefetchTiming::Earliest,
                )
                .map_err(|e| swap_err(format!("swap planner: {e}")))?;
                prep.policy = Some(plan.policy);
                prep.plan = Some(plan);
                prep.options = ExecOptions::planned(Some(budget));
                // a dynamic batch's structure rarely repeats, so a
                // profiled iteration (events on every op and copy, then a
                // second planning) would cost every batch more than a
                // later-placed prefetch can save: it keeps the estimates
                prep.stage = if rt.config.profile && prep.program.segments.is_empty() {
                    Stage::Profile
                } else {
                    Stage::Ready
                };
            }
        }
        Ok(())
    }

    /// Re-plans a profiled shape with the measured op times and bandwidths.
    fn replan(&self, rt: &SwapRuntime, prep: &mut Prepared, profile: &Profile) -> Result<()> {
        prep.stage = Stage::Ready;
        self.device.synchronize()?;
        let mut durations = Vec::with_capacity(profile.ops.len());
        for op in &profile.ops {
            let Some((start, end)) = op else {
                return Err(swap_err("swap profiling: an op was not timed"));
            };
            let ms = start.elapsed_ms(end).in_call("cuEventElapsedTime")?;
            durations.push(f64::from(ms.max(0.0)) * 1e-3);
        }
        let mut cost = CostModel::pcie5_x16();
        let mut moved = [(0usize, 0f64); 2];
        for (to_host, bytes, start, end) in &profile.copies {
            let s = f64::from(start.elapsed_ms(end).in_call("cuEventElapsedTime")?) * 1e-3;
            let m = &mut moved[usize::from(*to_host)];
            m.0 += bytes;
            m.1 += s;
        }
        let rate =
            |(bytes, s): (usize, f64)| (bytes > 1 << 20 && s > 0.0).then(|| bytes as f64 / s);
        if let Some(r) = rate(moved[0]) {
            cost.h2d_bytes_per_s = r;
        }
        if let Some(r) = rate(moved[1]) {
            cost.d2h_bytes_per_s = r;
        }
        let (Some(budget), Some(old)) = (prep.plan_budget, prep.plan.as_ref()) else {
            return Ok(());
        };
        let trace = prep
            .program
            .trace
            .with_durations(&durations)
            .map_err(|e| swap_err(format!("swap profiling: {e}")))?;
        match crate::swap::plan_training(&trace, budget, &rt.config, cost, PrefetchTiming::Profiled)
        {
            Ok(plan) => {
                prep.policy = Some(plan.policy);
                prep.plan = Some(plan);
                prep.program.trace = trace;
            }
            Err(e) => {
                // keep the earliest-placement plan, which did run
                let mut plan = old.clone();
                plan.notes
                    .push(format!("profiled re-planning failed, kept this plan: {e}"));
                prep.plan = Some(plan);
            }
        }
        Ok(())
    }
}
