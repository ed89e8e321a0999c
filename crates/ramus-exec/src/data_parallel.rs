//! Data-parallel training: every rank (one process per GPU, or a thread in
//! tests) holds a replica of the model, trains on its own shard of each
//! global batch, and the ranks' gradients are summed before every rank
//! applies the same optimizer step, so the replicas stay identical without
//! broadcasts after the first.
//!
//! The pieces, each behind a trait so that the wrapper is backend-neutral:
//!
//! * [`StepPlan`]: what every rank knows of a global step before it runs,
//!   worked out on the host from all ranks' graphs (each rank reads the
//!   same global order, so it holds them all): the head rows of the whole
//!   step and the embedding rows any rank's backward pass sets;
//! * [`SplitStep`]: an engine whose training step takes such a plan and
//!   sums its gradients and loss over the ranks before its update;
//! * [`Collective`]: what sums buffers and scalars over the ranks (NCCL on
//!   GPUs, threads of one process in `ramus-dist`'s local group);
//! * [`DataParallel`]: the wrapper, a [`TrainEngine`] around a
//!   [`SplitStep`] engine, as the swap path wraps the CUDA engine.
//!
//! # Equal to one batch of all ranks' graphs
//!
//! The loss is the mean over the head rows of a batch. A rank's gradients
//! are those of its own mean over its `rows_r` rows; scaled by
//! `rows_r / rows` (the rows of all ranks) and summed, they are the
//! gradients of the mean over the global batch: N ranks with batches of B
//! graphs take the steps of one engine with batches of N·B (up to the
//! order of float sums), whatever the rows per rank. The loss reported is
//! that global mean, summed with the gradients (on the device, for a GPU
//! engine): no rank waits for another's loss or rows before its update,
//! and a step's outcome comes back a step later, as on one GPU. Batch-norm statistics stay per rank (as in PyTorch's
//! `DistributedDataParallel`), so models with batch norm see per-rank
//! statistics in training; their running statistics are averaged over the
//! ranks before an evaluation or a checkpoint
//! ([`TrainEngine::sync_buffers`]).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use ramus_core::{Grads, HeadRows, Model, Real};

use crate::batch::{Batch, ForwardOutput, Mode};
use crate::engine::{StepOutcome, TrainEngine, TrainState};
use crate::error::{ExecError, Result};
pub use crate::step_plan::{RowSet, StepPlan};

/// A gradient buffer as an engine hands it to a [`Collective`]: in host
/// memory, or on the engine's device (an address and length in elements,
/// ordered on the engine's stream).
pub enum GradBuffer<'a, T> {
    Host(&'a mut [T]),
    Device(DeviceBuffer),
}

/// A device buffer of `len` elements at `ptr`, whose writes are ordered on
/// `stream` (raw handles: the collective and the engine share a context).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceBuffer {
    pub ptr: u64,
    pub len: usize,
    pub stream: u64,
}

/// What the ranks of a group exchange. Every rank calls the same methods in
/// the same order (a collective call that one rank skips hangs the others,
/// or, with a timeout, fails naming the rank).
pub trait Collective<T>: Send {
    /// This rank, `0..world()`.
    fn rank(&self) -> usize;
    /// How many ranks the group has.
    fn world(&self) -> usize;
    /// Replaces every rank's `values` with their sum over the ranks.
    fn sum_scalars(&mut self, values: &mut [f64]) -> Result<()>;
    /// Replaces every rank's buffers with their element-wise sums over the
    /// ranks, each rank's multiplied by its own `scale` first (`buffers`
    /// in the same order and sizes on every rank).
    fn sum_buffers(&mut self, buffers: Vec<GradBuffer<'_, T>>, scale: f64) -> Result<()>;
    /// Another handle on this rank's place in the group, for the
    /// collectives an engine makes inside its passes (synchronized batch
    /// normalisation): calls through either handle take their turns in one
    /// sequence. `None` where the group cannot make one.
    fn handle(&self) -> Option<Box<dyn Collective<T>>> {
        None
    }
}

/// An engine whose training step meets the other ranks where data
/// parallelism needs it (see the [module](self) docs): before its update,
/// its gradients and loss are summed over the ranks.
pub trait SplitStep<T: Real>: TrainEngine<T> {
    /// Before the steps of `batches` (this rank's, in order, one a step):
    /// host work an engine can do for all of them at once, ahead of their
    /// steps (the persistent engine lowers them in parallel). Nothing by
    /// default.
    fn prepare(&mut self, batches: &[Batch<'_>]) -> Result<()> {
        let _ = batches;
        Ok(())
    }

    /// This rank's part of `plan`'s step on `batch` (`None`: this rank
    /// has no graphs in it): the forward and backward passes, the
    /// gradients and the loss scaled by the rank's share of `plan.rows`
    /// ([`StepPlan::scale`]) and added to the step's sum; at its `last`
    /// batch that sum summed over `collective`'s ranks and the update over
    /// `plan.row_sets`. A step whose summed loss or a summed gradient is
    /// not finite is not applied, on every rank alike. Returns the
    /// outcomes that came back meanwhile, one per step: the mean loss over
    /// its global batch (an engine that overlaps steps returns each a step
    /// later, as [`TrainEngine::submit`] does).
    fn split_step(
        &mut self,
        collective: &mut dyn Collective<T>,
        batch: Option<&Batch<'_>>,
        plan: &StepPlan,
    ) -> Result<Vec<StepOutcome>>;
}

/// The group of one rank: gradient accumulation on one device runs
/// through [`DataParallel`] with it. Sums over one rank change nothing but
/// the scale, which it applies to host buffers; device buffers must come
/// with a scale of 1 (the engines scale their gradients before a step
/// they accumulated).
pub struct Alone;

impl<T: Real> Collective<T> for Alone {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn sum_scalars(&mut self, _values: &mut [f64]) -> Result<()> {
        Ok(())
    }
    fn sum_buffers(&mut self, buffers: Vec<GradBuffer<'_, T>>, scale: f64) -> Result<()> {
        for b in buffers {
            match b {
                GradBuffer::Host(v) if scale != 1.0 => {
                    let s = T::from_f64(scale);
                    v.iter_mut().for_each(|x| *x *= s);
                }
                GradBuffer::Host(_) => {}
                GradBuffer::Device(_) if scale != 1.0 => {
                    return Err(ExecError::Config(format!(
                        "a device buffer summed over one rank with scale {scale}: scale it \
                         on the device first"
                    )))
                }
                GradBuffer::Device(_) => {}
            }
        }
        Ok(())
    }
    fn handle(&self) -> Option<Box<dyn Collective<T>>> {
        Some(Box::new(Alone))
    }
}

/// A [`SplitStep`] engine trained data-parallel over a [`Collective`]'s
/// ranks: a [`TrainEngine`] whose [`submit`](TrainEngine::submit) takes
/// this rank's shard of each global batch, and whose steps' plans come
/// first, from [`TrainEngine::set_step_plans`].
pub struct DataParallel<T, E> {
    engine: E,
    collective: Box<dyn Collective<T>>,
    plans: VecDeque<StepPlan>,
    timing: StepTimes,
}

/// Host time the steps took (the host waits in them where an engine reads
/// a loss back), summed over steps.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTimes {
    pub steps: usize,
    pub host: Duration,
}

impl<T: Real, E: SplitStep<T>> DataParallel<T, E> {
    /// `engine` (a replica holding the same parameters as every other
    /// rank's) trained over `collective`'s ranks.
    pub fn new(engine: E, collective: Box<dyn Collective<T>>) -> Self {
        DataParallel {
            engine,
            collective,
            plans: VecDeque::new(),
            timing: StepTimes::default(),
        }
    }

    /// This rank and the number of ranks.
    pub fn rank(&self) -> (usize, usize) {
        (self.collective.rank(), self.collective.world())
    }

    /// The engine underneath.
    pub fn engine(&mut self) -> &mut E {
        &mut self.engine
    }

    /// One global step `plan` with this rank's shard of it (`None`: no
    /// graphs of this step fell to this rank, as in a short last batch);
    /// returns the outcomes that came back meanwhile.
    pub fn step(&mut self, shard: Option<&Batch<'_>>, plan: &StepPlan) -> Result<Vec<StepOutcome>> {
        let started = Instant::now();
        plan.check()?;
        let outcomes = self
            .engine
            .split_step(self.collective.as_mut(), shard, plan)?;
        self.timing.steps += 1;
        self.timing.host += started.elapsed();
        Ok(outcomes)
    }

    /// [`step`](Self::step), waiting for its outcome: the mean loss over
    /// the global batch, or [`ExecError::NonFinite`].
    pub fn step_shard(&mut self, shard: Option<&Batch<'_>>, plan: &StepPlan) -> Result<f64> {
        let mut outcomes = self.step(shard, plan)?;
        outcomes.extend(self.engine.finish()?);
        match outcomes.pop() {
            Some(outcome) => outcome.map_err(Into::into),
            None => Err(ExecError::Config("the step left no outcome".into())),
        }
    }

    /// The steps' host time since the last call, and the count starts again.
    pub fn take_times(&mut self) -> StepTimes {
        std::mem::take(&mut self.timing)
    }

    /// The plan of the next step, queued by [`TrainEngine::set_step_plans`].
    fn next_plan(&mut self) -> Result<StepPlan> {
        self.plans.pop_front().ok_or_else(|| {
            ExecError::Config("data-parallel step: no step plan was set for this step".into())
        })
    }
}

impl<T: Real, E: SplitStep<T>> TrainEngine<T> for DataParallel<T, E> {
    fn name(&self) -> &'static str {
        self.engine.name()
    }
    fn model(&self) -> &Model {
        self.engine.model()
    }
    fn forward_rows(
        &mut self,
        batch: &Batch<'_>,
        mode: Mode,
        rows: HeadRows,
    ) -> Result<ForwardOutput<T>> {
        self.engine.forward_rows(batch, mode, rows)
    }
    fn submit(&mut self, batches: &[Batch<'_>]) -> Result<Vec<StepOutcome>> {
        if batches.len() > 1 {
            self.engine.prepare(batches)?;
        }
        let mut outcomes = Vec::new();
        for b in batches {
            let plan = self.next_plan()?;
            outcomes.extend(self.step(Some(b), &plan)?);
        }
        Ok(outcomes)
    }
    fn finish(&mut self) -> Result<Vec<StepOutcome>> {
        self.engine.finish()
    }
    /// The engine's: a window of batches is prepared at once
    /// ([`SplitStep::prepare`]), then stepped one at a time.
    fn lookahead(&self) -> usize {
        self.engine.lookahead()
    }
    fn skips_nonfinite(&self) -> bool {
        self.engine.skips_nonfinite()
    }
    fn set_seed(&mut self, seed: u64) {
        self.engine.set_seed(seed);
    }
    fn set_lr(&mut self, lr: f64) -> Result<()> {
        self.engine.set_lr(lr)
    }
    fn set_step_lrs(&mut self, lrs: &[f64]) -> Result<()> {
        self.engine.set_step_lrs(lrs)
    }
    fn set_lr_scales(&mut self, scales: &[f64]) -> Result<()> {
        self.engine.set_lr_scales(scales)
    }
    fn state(&mut self) -> Result<TrainState<T>> {
        self.engine.state()
    }
    fn restore(&mut self, state: TrainState<T>) -> Result<()> {
        self.engine.restore(state)
    }
    fn memory_report(&self) -> Option<String> {
        self.engine.memory_report()
    }
    fn device_memory_room(&self) -> Option<u64> {
        self.engine.device_memory_room()
    }
    fn ranks(&self) -> (usize, usize) {
        self.rank()
    }
    /// The steps' host time, and the engine's own report after it.
    fn timing_report(&mut self) -> Option<String> {
        let t = self.take_times();
        let engine = self.engine.timing_report();
        (t.steps > 0).then(|| {
            format!(
                "{} ranks, per step: {:.2} ms on the host ({} steps){}",
                self.collective.world(),
                1e3 * t.host.as_secs_f64() / t.steps as f64,
                t.steps,
                engine.map(|e| format!("; {e}")).unwrap_or_default()
            )
        })
    }
    fn sum_over_ranks(&mut self, values: &mut [f64]) -> Result<()> {
        self.collective.sum_scalars(values)
    }
    fn submit_idle(&mut self) -> Result<Vec<StepOutcome>> {
        let plan = self.next_plan()?;
        self.step(None, &plan)
    }
    fn takes_step_plans(&self) -> bool {
        true
    }
    fn set_step_plans(&mut self, plans: Vec<StepPlan>) -> Result<()> {
        self.plans.extend(plans);
        Ok(())
    }
    /// A running statistic is a moving average, linear in the batches'
    /// statistics: the mean of the ranks' averages is the average of the
    /// ranks' mean statistics, so (for batch means over shards of equal
    /// size) what one engine would hold at N·B.
    fn sync_buffers(&mut self) -> Result<()> {
        let model = self.engine.model();
        let buffers: Vec<usize> = (0..model.params.len())
            .filter(|&p| model.is_buffer(p))
            .collect();
        if buffers.is_empty() || self.collective.world() == 1 {
            return Ok(());
        }
        let mut state = self.engine.state()?;
        let scale = 1.0 / self.collective.world() as f64;
        let values = &mut state.params.values;
        let host: Vec<GradBuffer<'_, T>> = values
            .iter_mut()
            .enumerate()
            .filter(|(p, _)| buffers.contains(p))
            .map(|(_, t)| GradBuffer::Host(t.data_mut()))
            .collect();
        self.collective.sum_buffers(host, scale)?;
        self.engine.restore(state)
    }
}

/// The gradients held on the host summed over the ranks: each set's rows
/// (`united`, every rank's, for the trained parameters in reverse
/// declaration order, as [`trained_params`] lists them) marked, so that every rank's optimizer visits the same rows, then
/// the gradients, this rank's scaled by `scale`, summed in that order (the
/// order a backward pass finishes them in); an embedding table's rows
/// travel packed, not the whole table.
pub fn reduce_host_grads<T: Real>(
    grads: &mut Grads<T>,
    collective: &mut dyn Collective<T>,
    scale: f64,
    united: &[RowSet],
) -> Result<()> {
    let trained = trained_params(grads);
    if united.len() != trained.len() {
        return Err(ExecError::Config(format!(
            "{} gradient row sets for {} trained parameters",
            united.len(),
            trained.len()
        )));
    }
    for (&p, set) in trained.iter().zip(united) {
        match set {
            RowSet::Dense => grads.mark_dense(p),
            RowSet::Rows(rows) => rows.iter().for_each(|&r| grads.mark_row(p, r)),
        }
    }
    grads.finish_rows();
    // rows of embedding tables, packed in `trained` order
    let mut packed: Vec<Vec<T>> = Vec::new();
    for (&p, set) in trained.iter().zip(united) {
        if let RowSet::Rows(rows) = set {
            let w = grads.row_width(p);
            let data = grads.values[p].data();
            packed.push(
                rows.iter()
                    .flat_map(|&r| &data[r as usize * w..(r as usize + 1) * w])
                    .copied()
                    .collect(),
            );
        }
    }
    {
        let mut dense: Vec<Option<&mut [T]>> = grads
            .values
            .iter_mut()
            .map(|t| Some(t.data_mut()))
            .collect();
        let mut rows = packed.iter_mut();
        let mut buffers = Vec::with_capacity(trained.len());
        for (&p, set) in trained.iter().zip(united) {
            let buffer = match set {
                RowSet::Dense => dense[p].take(),
                RowSet::Rows(_) => rows.next().map(|v| v.as_mut_slice()),
            };
            let buffer = buffer
                .ok_or_else(|| ExecError::Config(format!("gradient buffer {p} listed twice")))?;
            buffers.push(GradBuffer::Host(buffer));
        }
        collective.sum_buffers(buffers, scale)?;
    }
    let mut rows = packed.into_iter();
    for (&p, set) in trained.iter().zip(united) {
        if let RowSet::Rows(set_rows) = set {
            let w = grads.row_width(p);
            let summed = rows.next().unwrap_or_default();
            let data = grads.values[p].data_mut();
            for (k, &r) in set_rows.iter().enumerate() {
                data[r as usize * w..(r as usize + 1) * w]
                    .copy_from_slice(&summed[k * w..(k + 1) * w]);
            }
        }
    }
    Ok(())
}

/// The trained parameters, in reverse declaration order.
pub fn trained_params<T: Real>(grads: &Grads<T>) -> Vec<usize> {
    (0..grads.values.len())
        .rev()
        .filter(|&p| !grads.is_buffer(p))
        .collect()
}
