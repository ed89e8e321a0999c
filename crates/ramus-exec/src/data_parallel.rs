//! Data-parallel training: every rank (one process per GPU, or a thread in
//! tests) holds a replica of the model, trains on its own shard of each
//! global batch, and the ranks' gradients are summed before every rank
//! applies the same optimizer step, so the replicas stay identical without
//! broadcasts after the first.
//!
//! The pieces, each behind a trait so that the wrapper is backend-neutral:
//!
//! * [`SplitStep`]: an engine whose training step splits where it must
//!   meet the other ranks (the forward pass, then with what every rank's
//!   said, [`combine`]d, the backward pass, the gradients' sum and the
//!   update);
//! * [`Collective`]: what exchanges words and sums buffers and scalars over
//!   the ranks (NCCL on GPUs, threads of one process in `ramus-dist`'s
//!   local group);
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
//! that global mean. Batch-norm statistics stay per rank (as in PyTorch's
//! `DistributedDataParallel`), so models with batch norm see per-rank
//! statistics in training; their running statistics are averaged over the
//! ranks before an evaluation or a checkpoint
//! ([`TrainEngine::sync_buffers`]).

use std::time::{Duration, Instant};

use ramus_core::{Grads, Real};

use crate::batch::{Batch, ForwardOutput, Mode};
use crate::engine::{StepOutcome, TrainEngine, TrainState};
use crate::error::{ExecError, Result};
use ramus_core::{HeadRows, Model};

/// A rank's part of one step after its forward pass: its mean loss over
/// its head rows, how many rows that is (0 for a rank with no graphs in
/// this step), and which rows of each gradient its backward pass sets (in
/// an order of the engine's own, the same on every rank).
#[derive(Clone, Debug, PartialEq)]
pub struct LocalStep {
    pub loss: f64,
    pub rows: usize,
    pub row_sets: Vec<RowSet>,
}

/// What every rank's [`LocalStep`] makes of a step: the mean loss over all
/// ranks' head rows, this rank's share of those rows (its gradients'
/// scale), and each gradient's rows set on any rank.
#[derive(Clone, Debug, PartialEq)]
pub struct GlobalStep {
    pub loss: f64,
    pub scale: f64,
    pub row_sets: Vec<RowSet>,
}

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

/// Which rows of a parameter's gradient are set: all of them (a dense
/// gradient), or some rows of an embedding table (sorted, unique).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RowSet {
    Dense,
    Rows(Vec<u32>),
}

/// A device engine's row lists (per row-gradient table: its id and rows)
/// as the row sets of its [`LocalStep`].
pub fn row_sets_of(lists: &[(usize, Vec<u32>)]) -> Vec<RowSet> {
    lists
        .iter()
        .map(|(_, rows)| RowSet::Rows(rows.clone()))
        .collect()
}

/// Replaces each row list of `lists` with the rows every rank's step sets
/// (`united`, from the [`GlobalStep`], in the same order); a table that
/// came back dense is an error (an engine with row lists never reports one).
pub fn take_united_rows(lists: &mut [(usize, Vec<u32>)], united: Vec<RowSet>) -> Result<()> {
    for ((_, rows), set) in lists.iter_mut().zip(united) {
        match set {
            RowSet::Rows(all) => *rows = all,
            RowSet::Dense => {
                return Err(ExecError::Device(
                    "a row-gradient table came back dense from the other ranks".into(),
                ))
            }
        }
    }
    Ok(())
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
    /// Every rank's `words` (the same number on every rank), concatenated
    /// in rank order.
    fn gather_words(&mut self, words: &[u32]) -> Result<Vec<u32>>;
    /// Replaces every rank's buffers with their element-wise sums over the
    /// ranks, each rank's multiplied by its own `scale` first (`buffers`
    /// in the same order and sizes on every rank).
    fn sum_buffers(&mut self, buffers: Vec<GradBuffer<'_, T>>, scale: f64) -> Result<()>;
}

/// An engine whose training step splits where data parallelism needs it
/// (see the [module](self) docs): a forward pass that says what the step
/// needs from the other ranks, then the rest of the step with what they
/// said.
pub trait SplitStep<T: Real>: TrainEngine<T> {
    /// Before the steps of `batches` (this rank's, in order, one a step):
    /// host work an engine can do for all of them at once, ahead of their
    /// steps (the persistent engine lowers them in parallel). Nothing by
    /// default.
    fn prepare(&mut self, batches: &[Batch<'_>]) -> Result<()> {
        let _ = batches;
        Ok(())
    }

    /// The forward pass on `batch` (`None`: this rank has no graphs in this
    /// step), and the backward pass too where the engine learns only then
    /// which rows its gradients set.
    fn local_step(&mut self, batch: Option<&Batch<'_>>) -> Result<LocalStep>;

    /// The rest of the step begun by [`local_step`](Self::local_step) on
    /// the same `batch`: the gradients, their sums over `collective`'s
    /// ranks (this rank's scaled by `step.scale`), and the update over
    /// `step.row_sets`, checking `step.loss`. A step whose loss or a summed
    /// gradient is not finite is not applied, on every rank alike. Returns
    /// the outcomes that came back meanwhile (an engine that overlaps steps
    /// returns each a step later, as [`TrainEngine::submit`] does).
    fn global_step(
        &mut self,
        collective: &mut dyn Collective<T>,
        batch: Option<&Batch<'_>>,
        step: GlobalStep,
    ) -> Result<Vec<StepOutcome>>;
}

/// Every rank's [`LocalStep`] combined in (at most) two exchanges of words:
/// each rank's loss, rows and row-set sizes, then the rows of the sets.
/// Returns the sum of the ranks' loss × rows, the rows of all ranks, and
/// each set united over the ranks (dense where any rank's is).
pub fn combine<T>(
    collective: &mut dyn Collective<T>,
    local: &LocalStep,
) -> Result<(f64, usize, Vec<RowSet>)> {
    const DENSE: u32 = u32::MAX;
    let loss_sum = match local.rows {
        0 => 0.0,
        rows => local.loss * rows as f64,
    };
    let bits = loss_sum.to_bits();
    let mut header = vec![bits as u32, (bits >> 32) as u32, word(local.rows)?];
    for set in &local.row_sets {
        header.push(match set {
            RowSet::Dense => DENSE,
            RowSet::Rows(rows) => word(rows.len())?,
        });
    }
    let width = header.len();
    let all = collective.gather_words(&header)?;
    if all.len() != width * collective.world() {
        return Err(ExecError::Config(format!(
            "data-parallel step: the ranks' steps have other numbers of gradient row sets \
             ({} words from {} ranks, {width} here)",
            all.len(),
            collective.world()
        )));
    }
    let ranks: Vec<&[u32]> = all.chunks(width).collect();
    let (mut loss, mut rows) = (0.0, 0usize);
    for r in &ranks {
        loss += f64::from_bits(r[0] as u64 | (r[1] as u64) << 32);
        rows += r[2] as usize;
    }
    // per set: dense anywhere, or the longest list (the width it is sent at)
    let sets = local.row_sets.len();
    let longest: Vec<Option<usize>> = (0..sets)
        .map(|s| {
            let lens = ranks.iter().map(|r| r[3 + s]);
            match lens.clone().any(|l| l == DENSE) {
                true => None,
                false => lens.max().map(|l| l as usize),
            }
        })
        .collect();
    let mut padded = Vec::new();
    for (set, width) in local.row_sets.iter().zip(&longest) {
        if let (RowSet::Rows(rows), Some(width)) = (set, width) {
            padded.extend(rows.iter().copied());
            padded.resize(padded.len() + width - rows.len(), DENSE);
        }
    }
    let gathered = match padded.is_empty() {
        true => Vec::new(),
        false => collective.gather_words(&padded)?,
    };
    let stride = padded.len();
    let mut united = Vec::with_capacity(sets);
    let mut at = 0;
    for width in longest {
        let Some(width) = width else {
            united.push(RowSet::Dense);
            continue;
        };
        let mut rows: Vec<u32> = (0..collective.world())
            .flat_map(|r| {
                gathered[r * stride + at..r * stride + at + width]
                    .iter()
                    .copied()
            })
            .filter(|&row| row != DENSE)
            .collect();
        rows.sort_unstable();
        rows.dedup();
        united.push(RowSet::Rows(rows));
        at += width;
    }
    Ok((loss, rows, united))
}

fn word(n: usize) -> Result<u32> {
    u32::try_from(n)
        .ok()
        .filter(|&w| w != u32::MAX)
        .ok_or_else(|| ExecError::Config(format!("data-parallel step: {n} rows is too many")))
}

/// A [`SplitStep`] engine trained data-parallel over a [`Collective`]'s
/// ranks: a [`TrainEngine`] whose [`submit`](TrainEngine::submit) takes
/// this rank's shard of each global batch.
pub struct DataParallel<T, E> {
    engine: E,
    collective: Box<dyn Collective<T>>,
    timing: PhaseTimes,
}

/// Where the steps' time went, summed over steps (host wall clock).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PhaseTimes {
    pub steps: usize,
    /// The forward passes ([`SplitStep::local_step`]).
    pub local: Duration,
    /// The exchanges of losses, rows and row sets ([`combine`]).
    pub exchange: Duration,
    /// The rest of the steps ([`SplitStep::global_step`]).
    pub global: Duration,
}

impl<T: Real, E: SplitStep<T>> DataParallel<T, E> {
    /// `engine` (a replica holding the same parameters as every other
    /// rank's) trained over `collective`'s ranks.
    pub fn new(engine: E, collective: Box<dyn Collective<T>>) -> Self {
        DataParallel {
            engine,
            collective,
            timing: PhaseTimes::default(),
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

    /// One global step with this rank's shard of it (`None`: no graphs of
    /// this step fell to this rank, as in a short last batch); returns the
    /// outcomes that came back meanwhile.
    pub fn step(&mut self, shard: Option<&Batch<'_>>) -> Result<Vec<StepOutcome>> {
        let started = Instant::now();
        let local = self.engine.local_step(shard)?;
        let forward = Instant::now();
        let (loss_sum, rows, row_sets) = combine(self.collective.as_mut(), &local)?;
        let exchanged = Instant::now();
        if rows == 0 {
            return Err(ExecError::Config(
                "data-parallel step: no rank had a head row in this step".into(),
            ));
        }
        let step = GlobalStep {
            loss: loss_sum / rows as f64,
            scale: local.rows as f64 / rows as f64,
            row_sets,
        };
        let outcomes = self
            .engine
            .global_step(self.collective.as_mut(), shard, step)?;
        self.timing.steps += 1;
        self.timing.local += forward - started;
        self.timing.exchange += exchanged - forward;
        self.timing.global += exchanged.elapsed();
        Ok(outcomes)
    }

    /// [`step`](Self::step), waiting for its outcome: the mean loss over
    /// the global batch, or [`ExecError::NonFinite`].
    pub fn step_shard(&mut self, shard: Option<&Batch<'_>>) -> Result<f64> {
        let mut outcomes = self.step(shard)?;
        outcomes.extend(self.engine.finish()?);
        match outcomes.pop() {
            Some(outcome) => outcome.map_err(Into::into),
            None => Err(ExecError::Config("the step left no outcome".into())),
        }
    }

    /// The phases' times since the last call, and the count starts again.
    pub fn take_times(&mut self) -> PhaseTimes {
        std::mem::take(&mut self.timing)
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
            outcomes.extend(self.step(Some(b))?);
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
    fn timing_report(&mut self) -> Option<String> {
        let t = self.take_times();
        let per = |d: Duration| 1e3 * d.as_secs_f64() / t.steps.max(1) as f64;
        (t.steps > 0).then(|| {
            format!(
                "{} ranks, per step: forward {:.2} ms, exchange of losses and rows {:.2} ms, \
                 backward, gradient sum and update {:.2} ms ({} steps)",
                self.collective.world(),
                per(t.local),
                per(t.exchange),
                per(t.global),
                t.steps
            )
        })
    }
    fn sum_over_ranks(&mut self, values: &mut [f64]) -> Result<()> {
        self.collective.sum_scalars(values)
    }
    fn submit_idle(&mut self) -> Result<Vec<StepOutcome>> {
        self.step(None)
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
/// (`row_sets`, every rank's united by [`combine`], for the trained
/// parameters in reverse declaration order, as [`host_row_sets`] lists
/// them) marked, so that every rank's optimizer visits the same rows, then
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
fn trained_params<T: Real>(grads: &Grads<T>) -> Vec<usize> {
    (0..grads.values.len())
        .rev()
        .filter(|&p| !grads.is_buffer(p))
        .collect()
}

/// The rows each trained parameter's gradient sets, in the order
/// [`reduce_host_grads`] takes them.
pub fn host_row_sets<T: Real>(grads: &Grads<T>) -> Vec<RowSet> {
    trained_params(grads)
        .into_iter()
        .map(|p| match &grads.touched_rows[p] {
            None => RowSet::Dense,
            Some(rows) => RowSet::Rows(rows.clone()),
        })
        .collect()
}
