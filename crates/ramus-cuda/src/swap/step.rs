//! One swap-path iteration on the engine: a training step of a
//! static-graph model, or of a dynamic one cut into segments (cached by
//! the batch's structure), or a forward pass, run op by op by the
//! [`ramus_swap::Executor`], with [`CudaSwapDevice`] carrying out its
//! orders; and the choice of mode, budget and plan for each batch shape.

use ramus_core::{HeadRows, Model, Params};
use ramus_exec::{fill_dropout_mask, Batch, ForwardOutput, Mode};
use ramus_exec::{OptimizerConfig, StepOutcome};
use ramus_swap::{analyze, CostModel, ExecOptions, Executor, Policy, PrefetchTiming, SwapPlan};

use super::device::CudaSwapDevice;
use super::runtime::{PrepKey, Prepared, Profile, Slot, Stage, SwapRuntime, Training, Update};
use super::steps::{self, Kind, Shape, SwapOp, SwapProgram};
use super::{SwapMode, SwapStepReport};
use crate::engine::CudaEngine;
use crate::error::{model_err, InCall, Result};
use crate::pool::DeviceView;

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
        .map_err(|e| model_err(format!("no-swap layout: {e}")))?;
    let arena = plan.layout.as_ref().map_or(0, |l| l.arena_bytes);
    let needed = program.trace.persistent_bytes().saturating_add(arena);
    Ok((room.is_none_or(|r| needed <= r)).then_some(plan))
}

impl SwapRuntime {
    /// The trace and plan of `model`'s training iteration on `batch`, if
    /// this batch shape was run (a profiled plan appears after the first
    /// step of the shape).
    pub(super) fn plan_of(
        &self,
        engine: &CudaEngine,
        model: &Model,
        batch: &Batch<'_>,
    ) -> Option<(ramus_swap::Trace, Option<SwapPlan>)> {
        let states = engine
            .optimizer
            .as_ref()
            .map_or(0, |(_, o)| steps::optimizer_states(o.config().kind));
        let kind = Kind::Train { states };
        let (key, _) = self
            .program_for(engine, model, &batch.schedule, model.head.rows, kind)
            .ok()?;
        let prep = self.prepared.get(&key)?;
        Some((prep.program.trace.clone(), prep.plan.clone()))
    }

    /// The cache key of `kind`'s iteration on batch `s`, with the program
    /// already built for a dynamic model (whose key is its fingerprint).
    fn program_for(
        &self,
        engine: &CudaEngine,
        model: &Model,
        s: &ramus_graph::Schedule,
        rows: HeadRows,
        kind: Kind,
    ) -> Result<(PrepKey, Option<SwapProgram>)> {
        if steps::check_static(model, &engine.program).is_ok() {
            return Ok((PrepKey::Static(Shape::of(model, s, rows), kind), None));
        }
        let program = steps::build_dynamic(
            model,
            &engine.program,
            s,
            rows,
            kind,
            engine.conv_workspace,
            crate::swap::segment_rows(model, &self.config),
        )?;
        Ok((PrepKey::Dynamic(program.fingerprint(), kind), Some(program)))
    }

    /// One training step on the swap path: forward, backward and (with
    /// `update` [`Update::Fused`]) the fused optimizer update, op by op
    /// under the executor. A split step leaves the update to its caller
    /// and returns the batch's head rows with the step before's outcome.
    pub(super) fn train_step(
        &mut self,
        engine: &mut CudaEngine,
        (model, params): (&Model, &mut Params<f32>),
        config: &OptimizerConfig,
        batch: &Batch<'_>,
        update: Update,
    ) -> Result<(Option<StepOutcome>, usize)> {
        engine.check_model(model)?;
        engine.track_running_stats = true;
        let result = self.swap_step(engine, (model, params), config, batch, update);
        engine.track_running_stats = false;
        if result.is_err() {
            self.abandon(engine);
        }
        result
    }

    fn swap_step(
        &mut self,
        engine: &mut CudaEngine,
        (model, params): (&Model, &mut Params<f32>),
        config: &OptimizerConfig,
        batch: &Batch<'_>,
        update: Update,
    ) -> Result<(Option<StepOutcome>, usize)> {
        let s = &batch.schedule;
        // an evaluation pass may have grown the arena: the tensors need that room
        engine.reset_batch(true)?;
        engine.sync_params(model, params)?;
        engine.inference_pass = false;
        engine.upload_indices(model, s, Mode::Train, model.head.rows)?;
        // the optimizer's state is part of the fixed memory: allocate it
        // first; a skipped step puts back the running statistics of before
        // its first batch
        if update != (Update::Split { first: false }) {
            engine.keep_buffers(model, config)?;
        }
        let kind = Kind::Train {
            states: steps::optimizer_states(config.kind),
        };
        let (key, fresh) = self.program_for(engine, model, s, model.head.rows, kind)?;
        let mut prep = self.prepared(engine, model, &key, fresh)?;
        let training = Training { config, update };
        let result = self.swap_run(engine, &mut prep, model, Some(training), batch);
        self.keep(key, prep);
        let (loss, _) = result?;
        // the step before's status came back before this step's loss
        let previous = engine.settle_step()?;
        if update == Update::Fused {
            engine.step_submitted(params, crate::engine::StepLoss::Host(loss));
        }
        Ok((previous, engine.batch_head_vertices().len()))
    }

    /// The prepared iteration for `key`, taken out of the runtime's cache
    /// (built if new; the caller puts it back). A dynamic batch brings its
    /// `fresh` program: a cached one of the same structure keeps its plan
    /// and takes the new batch's index words.
    fn prepared(
        &mut self,
        engine: &CudaEngine,
        model: &Model,
        key: &PrepKey,
        fresh: Option<SwapProgram>,
    ) -> Result<Prepared> {
        let program = match (self.prepared.remove(key), fresh, key) {
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
                steps::build(model, &engine.program, shape, *kind, engine.conv_workspace)?
            }
            (_, None, PrepKey::Dynamic(..)) => {
                return Err(model_err("swap path: a dynamic batch without its program"))
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

    /// The forward pass of a static-graph or dynamic model on the swap
    /// path (evaluation and inference): op by op, each tensor freed after
    /// its last use, so batches whose activations all together exceed the
    /// budget still run.
    pub(super) fn forward(
        &mut self,
        engine: &mut CudaEngine,
        model: &Model,
        params: &Params<f32>,
        batch: &Batch<'_>,
        mode: Mode,
        rows: HeadRows,
    ) -> Result<ForwardOutput<f32>> {
        engine.check_model(model)?;
        let result = self.swap_forward_in(engine, model, params, batch, mode, rows);
        if result.is_err() {
            self.abandon(engine);
        }
        result
    }

    fn swap_forward_in(
        &mut self,
        engine: &mut CudaEngine,
        model: &Model,
        params: &Params<f32>,
        batch: &Batch<'_>,
        mode: Mode,
        rows: HeadRows,
    ) -> Result<ForwardOutput<f32>> {
        let s = &batch.schedule;
        // an evaluation pass may have grown the arena: the tensors need that room
        engine.reset_batch(true)?;
        engine.sync_params(model, params)?;
        engine.inference_pass = mode != Mode::Train;
        engine.upload_indices(model, s, mode, rows)?;
        let kind = if mode == Mode::Infer {
            Kind::Infer
        } else {
            Kind::Evaluate
        };
        let (key, fresh) = self.program_for(engine, model, s, rows, kind)?;
        let mut prep = self.prepared(engine, model, &key, fresh)?;
        let result = self.swap_run(engine, &mut prep, model, None, batch);
        self.keep(key, prep);
        let (loss, logits) = result?;
        let classes = model
            .head
            .logits
            .map_or(0, |l| model.head.forward.nodes[l].ty.width());
        Ok(ForwardOutput {
            loss: (mode != Mode::Infer).then_some(loss),
            head_vertices: engine.batch_head_vertices().to_vec(),
            logits,
            classes,
        })
    }

    /// After a failed step: leaves no copy in flight and no tensor allocated.
    fn abandon(&mut self, engine: &CudaEngine) {
        let drained = engine.device.synchronize().and_then(|()| self.drain());
        for slot in &mut self.slots {
            slot.mem = None;
            slot.write_after.clear();
        }
        if drained.is_ok() {
            self.arena = None;
        } else if let Some(arena) = self.arena.take() {
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
        engine: &mut CudaEngine,
        prep: &mut Prepared,
        model: &Model,
        training: Option<Training<'_>>,
        batch: &Batch<'_>,
    ) -> Result<(f64, Vec<f32>)> {
        let nt = prep.program.trace.num_tensors();
        if self.slots.len() < nt {
            self.slots.resize_with(nt, Slot::default);
        }
        // the lane's scratch memory, reserved up front at its largest
        let ws_len = prep.program.workspace_floats;
        if self.workspace.as_ref().is_none_or(|w| w.len() < ws_len) {
            self.workspace = None;
            self.workspace = Some(engine.pool.alloc::<f32>(ws_len.max(1))?);
        }
        if let Some(w) = &self.workspace {
            engine.main.workspace.set(Some(w.view()));
        }
        // dropout masks, drawn in the plain engine's order
        let mut masks = Vec::with_capacity(prep.program.masks.len());
        for &(_, _, len, rate) in &prep.program.masks {
            let mut mask = vec![0f32; len];
            fill_dropout_mask(&mut mask, rate, true, &mut engine.rng);
            masks.push(mask);
        }
        if prep.stage == Stage::New {
            let started = std::time::Instant::now();
            self.decide(engine, prep)?;
            prep.plan_seconds = started.elapsed().as_secs_f64();
            prep.planned_now = true;
        }
        // the index words of a dynamic batch's moves
        let move_indices = if prep.program.indices.is_empty() {
            None
        } else {
            Some(engine.upload_indices_of(&prep.program.indices, &|| {
                "the index words of the swap path's row moves".into()
            })?)
        };
        // the embedding rows the batch touches (the optimizer updates only
        // those), uploaded with the index words before any op runs
        let touched: Vec<DeviceView<u32>> = if Training::fused(training) {
            engine
                .touched_rows(model, &batch.schedule)?
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
                    self.ensure_host(a.tensor().index(), home.len * 4, &engine.device)?;
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
                engine,
                rt: &mut *self,
                program: &prep.program,
                move_indices,
                touched,
                model,
                training,
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
            f64::from(
                self.loss
                    .host::<f32>(1)?
                    .first()
                    .copied()
                    .unwrap_or(f32::NAN),
            )
        } else {
            f64::NAN
        };
        let logits = if has(SwapOp::ReadLogits) {
            self.logits.host::<f32>(self.logits_len)?.to_vec()
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
            self.replan(engine, prep, &profile)?;
        }
        self.report = Some(SwapStepReport {
            mode: self.config.mode,
            policy: prep.policy,
            ops: prep.program.trace.num_ops(),
            tensors: nt,
            device_budget: engine.pool.max_bytes(),
            overhead_bytes: prep.overhead,
            plan_budget: prep.plan_budget,
            trace_peak_bytes: prep.trace_peak,
            profiled: profiling,
            arena_bytes,
            exec,
            pool_peak_bytes: engine.pool.stats().peak_in_use_bytes,
            segments: prep.program.segments.len(),
            plan_seconds: prep.planned_now.then_some(prep.plan_seconds),
        });
        Ok((loss, logits))
    }

    /// Decides the mode, budget and first plan of a batch shape, from the
    /// memory in use now (everything but the iteration's tensors).
    fn decide(&self, engine: &CudaEngine, prep: &mut Prepared) -> Result<()> {
        let trace = &prep.program.trace;
        let in_use = engine.pool.stats().in_use_bytes;
        prep.overhead = in_use.saturating_sub(trace.persistent_bytes());
        let cost = CostModel::pcie5_x16();
        prep.trace_peak = analyze(trace, &cost).peak_bytes;
        let device_budget = engine.pool.max_bytes();
        // the plan's arena is one block of the pool: no more than its
        // largest free range
        let persistent = trace.persistent_bytes();
        let room = engine
            .pool
            .largest_free_block()
            .map(|l| persistent.saturating_add(l));
        prep.plan_budget = device_budget.map(|b| {
            let planned = crate::swap::plan_budget(b, prep.overhead, &self.config);
            room.map_or(planned, |r| planned.min(r))
        });
        if !matches!(prep.program.kind, Kind::Train { .. }) {
            // a forward pass frees as it goes; should it still not fit,
            // naive swapping (unless no swapping was asked for)
            prep.stage = Stage::Ready;
            if self.config.mode == SwapMode::Resident {
                prep.policy = None;
                prep.options = ExecOptions::resident(None);
            } else {
                prep.policy = Some(Policy::Lru);
                prep.options = ExecOptions::on_demand(None);
            }
            return Ok(());
        }
        let mode = match self.config.mode {
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
                    model_err(
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
                    .map_err(|e| model_err(format!("swap planner: {e}")))?;
                let plan = crate::swap::plan_training(
                    &estimated,
                    budget,
                    &self.config,
                    cost,
                    PrefetchTiming::Earliest,
                )
                .map_err(|e| model_err(format!("swap planner: {e}")))?;
                prep.policy = Some(plan.policy);
                prep.plan = Some(plan);
                prep.options = ExecOptions::planned(Some(budget));
                // a dynamic batch's structure rarely repeats, so a
                // profiled iteration (events on every op and copy, then a
                // second planning) would cost every batch more than a
                // later-placed prefetch can save: it keeps the estimates
                prep.stage = if self.config.profile && prep.program.segments.is_empty() {
                    Stage::Profile
                } else {
                    Stage::Ready
                };
            }
        }
        Ok(())
    }

    /// Re-plans a profiled shape with the measured op times and bandwidths.
    fn replan(&self, engine: &CudaEngine, prep: &mut Prepared, profile: &Profile) -> Result<()> {
        prep.stage = Stage::Ready;
        engine.device.synchronize()?;
        let mut durations = Vec::with_capacity(profile.ops.len());
        for op in &profile.ops {
            let Some((start, end)) = op else {
                return Err(model_err("swap profiling: an op was not timed"));
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
            .map_err(|e| model_err(format!("swap profiling: {e}")))?;
        match crate::swap::plan_training(
            &trace,
            budget,
            &self.config,
            cost,
            PrefetchTiming::Profiled,
        ) {
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
