//! Data-parallel training: every rank (one process per GPU, or a thread in
//! tests) holds a replica of the model, trains on its own shard of each
//! global batch, and the ranks' gradients are summed before every rank
//! applies the same optimizer step, so the replicas stay identical without
//! broadcasts after the first.
//!
//! The pieces, each behind a trait so that the wrapper is backend-neutral:
//!
//! * [`SplitStep`]: an engine whose training step splits where the
//!   gradients must meet the other ranks' (forward and backward, then the
//!   reduction of its gradient buffers, then the update);
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
//! that global mean. Batch-norm statistics stay per rank (as in PyTorch's
//! `DistributedDataParallel`), so models with batch norm see per-rank
//! statistics in training.

use ramus_core::{Grads, Real};

use crate::batch::{Batch, ForwardOutput, Mode};
use crate::engine::{step_outcome, StepOutcome, TrainEngine, TrainState};
use crate::error::{ExecError, Result};
use ramus_core::{HeadRows, Model};

/// A rank's part of one step, before the gradients are reduced: its mean
/// loss over its head rows, and how many rows that is (0 for a rank with
/// no graphs in this step).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LocalStep {
    pub loss: f64,
    pub rows: usize,
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

/// Sums over the ranks of a group. Every rank calls the same methods in the
/// same order (a collective call that one rank skips hangs the others, or,
/// with a timeout, fails naming the rank).
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
    /// The union over the ranks of each parameter's set rows (dense where
    /// any rank's gradient is dense).
    fn unite_rows(&mut self, sets: Vec<RowSet>) -> Result<Vec<RowSet>>;
}

/// An engine whose training step splits where data parallelism needs it
/// (see the [module](self) docs). The three calls make one step, in order.
pub trait SplitStep<T: Real>: TrainEngine<T> {
    /// Forward and backward on `batch` into the engine's gradient buffers
    /// (`None`: this rank has no graphs in this step, and its gradients
    /// are zero).
    fn local_gradients(&mut self, batch: Option<&Batch<'_>>) -> Result<LocalStep>;

    /// Replaces the gradients with their sums over `collective`'s ranks,
    /// this rank's scaled by `scale`.
    fn reduce_gradients(&mut self, collective: &mut dyn Collective<T>, scale: f64) -> Result<()>;

    /// The optimizer step with the reduced gradients, reporting `loss`.
    /// Not applied (the state stays as it was) when `loss` or a gradient is
    /// not finite: [`ExecError::NonFinite`], the same on every rank, since
    /// every rank holds the same sums.
    fn apply_update(&mut self, loss: f64) -> Result<f64>;
}

/// A [`SplitStep`] engine trained data-parallel over a [`Collective`]'s
/// ranks: a [`TrainEngine`] whose [`submit`](TrainEngine::submit) takes
/// this rank's shard of each global batch.
pub struct DataParallel<T, E> {
    engine: E,
    collective: Box<dyn Collective<T>>,
}

impl<T: Real, E: SplitStep<T>> DataParallel<T, E> {
    /// `engine` (a replica holding the same parameters as every other
    /// rank's) trained over `collective`'s ranks.
    pub fn new(engine: E, collective: Box<dyn Collective<T>>) -> Self {
        DataParallel { engine, collective }
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
    /// mean loss over the global batch.
    pub fn step_shard(&mut self, shard: Option<&Batch<'_>>) -> Result<f64> {
        let local = self.engine.local_gradients(shard)?;
        let mut sums = [local.loss * local.rows as f64, local.rows as f64];
        if local.rows == 0 {
            sums[0] = 0.0;
        }
        self.collective.sum_scalars(&mut sums)?;
        let [loss_sum, rows] = sums;
        if rows < 1.0 {
            return Err(ExecError::Config(
                "data-parallel step: no rank had a head row in this step".into(),
            ));
        }
        let scale = local.rows as f64 / rows;
        self.engine
            .reduce_gradients(self.collective.as_mut(), scale)?;
        self.engine.apply_update(loss_sum / rows)
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
        batches
            .iter()
            .map(|b| step_outcome(self.step_shard(Some(b))))
            .collect()
    }
    fn finish(&mut self) -> Result<Vec<StepOutcome>> {
        self.engine.finish()
    }
    fn skips_nonfinite(&self) -> bool {
        self.engine.skips_nonfinite()
    }
    fn set_seed(&mut self, seed: u64) {
        self.engine.set_seed(seed);
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
    fn sum_over_ranks(&mut self, values: &mut [f64]) -> Result<()> {
        self.collective.sum_scalars(values)
    }
    fn submit_idle(&mut self) -> Result<Vec<StepOutcome>> {
        Ok(vec![step_outcome(self.step_shard(None))?])
    }
}

/// [`SplitStep::reduce_gradients`] for gradients held on the host: every
/// rank's set rows are united (so that each rank's optimizer visits the
/// same rows), then the trained parameters' gradients, this rank's
/// scaled by `scale`, are summed over the ranks in reverse declaration
/// order (the order a backward pass finishes them in); an embedding
/// table's rows travel packed, not the whole table.
pub fn reduce_host_grads<T: Real>(
    grads: &mut Grads<T>,
    collective: &mut dyn Collective<T>,
    scale: f64,
) -> Result<()> {
    let trained: Vec<usize> = (0..grads.values.len())
        .rev()
        .filter(|&p| !grads.is_buffer(p))
        .collect();
    let sets = trained
        .iter()
        .map(|&p| match &grads.touched_rows[p] {
            None => RowSet::Dense,
            Some(rows) => RowSet::Rows(rows.clone()),
        })
        .collect();
    let united = collective.unite_rows(sets)?;
    for (&p, set) in trained.iter().zip(&united) {
        match set {
            RowSet::Dense => grads.mark_dense(p),
            RowSet::Rows(rows) => rows.iter().for_each(|&r| grads.mark_row(p, r)),
        }
    }
    grads.finish_rows();
    // rows of embedding tables, packed in `trained` order
    let mut packed: Vec<Vec<T>> = Vec::new();
    for (&p, set) in trained.iter().zip(&united) {
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
        for (&p, set) in trained.iter().zip(&united) {
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
    for (&p, set) in trained.iter().zip(&united) {
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
