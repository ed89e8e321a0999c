//! Training and evaluation loops over any [`TrainEngine`] (the CPU batched
//! engine by default).

use std::collections::VecDeque;
use std::sync::mpsc::SyncSender;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use ramus_core::{HeadRows, Model, Params, Real};
use ramus_cpu::CpuTrainer;
use ramus_exec::data_parallel::StepPlan;
use ramus_exec::nonfinite::BatchPlace;
use ramus_exec::{
    Batch, ExecError, Mode, NonFiniteFault, OnNonFinite, OptimizerConfig, Result, StepOutcome,
    TrainEngine, TrainState,
};

use ramus_dist::Shard;
use ramus_graph::{BatchingPolicy, InputGraph, NO_LABEL};

/// Accuracy and loss over a data set.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EvalResult {
    /// Mean loss per batch, weighted by graphs.
    pub loss: f64,
    /// Fraction of labelled roots (vertices without a parent) classified
    /// correctly: one per tree or pyramid, so the fraction of sentences;
    /// every word's output vertex in a tagger graph.
    pub root_accuracy: f64,
    /// Fraction of labelled vertices classified correctly.
    pub node_accuracy: f64,
    pub graphs: usize,
}

/// The training and evaluation loops around a [`TrainEngine`], which owns
/// the model's training state (parameters, optimizer, dropout stream): read
/// it back with [`Trainer::state`].
pub struct Trainer<T> {
    pub engine: Box<dyn TrainEngine<T>>,
    pub policy: BatchingPolicy,
    /// What a batch whose loss or a gradient is not finite does.
    pub on_nonfinite: OnNonFinite,
    /// Batches per optimizer step (gradient accumulation): a step sums
    /// the gradients of this many consecutive batches, as one batch of
    /// them all would (the engine must take step plans: a
    /// [`ramus_exec::data_parallel::DataParallel`] one).
    pub accumulate: usize,
}

impl<T: Real> Trainer<T> {
    /// Trains `model` from `params` on the CPU batched engine.
    pub fn new(model: Model, params: Params<T>, config: OptimizerConfig) -> Self {
        Self::with_engine(Box::new(CpuTrainer::new(model, params, config)))
    }

    /// Trains on `engine` (built for its model, holding its state).
    pub fn with_engine(engine: Box<dyn TrainEngine<T>>) -> Self {
        Trainer {
            engine,
            policy: BatchingPolicy::Cavs,
            on_nonfinite: OnNonFinite::Stop,
            accumulate: 1,
        }
    }

    /// The model trained.
    pub fn model(&self) -> &Model {
        self.engine.model()
    }

    /// The training state (see [`TrainEngine::state`]).
    pub fn state(&mut self) -> Result<TrainState<T>> {
        self.engine.state()
    }

    /// Refuses [`OnNonFinite::SkipBatch`] on an engine that cannot hold a
    /// non-finite update back (see [`TrainEngine::skips_nonfinite`]).
    pub fn check_nonfinite_policy(&self) -> Result<()> {
        if self.on_nonfinite == OnNonFinite::SkipBatch && !self.engine.skips_nonfinite() {
            return Err(ExecError::Config(format!(
                "--on-nonfinite skip-batch: the {} engine applies each update inside its \
                 training kernel and cannot skip a batch; use --on-nonfinite stop or another engine",
                self.engine.name()
            )));
        }
        Ok(())
    }

    /// Forward, backward and one optimizer step on `graphs`; returns the
    /// loss, or [`ExecError::NonFinite`] for a step not applied (its loss or
    /// a gradient was not finite).
    pub fn train_batch(&mut self, graphs: &[&InputGraph]) -> Result<f64> {
        let batch = Batch::new(self.engine.model(), graphs.to_vec(), self.policy)?;
        self.engine.train_step(&batch)
    }

    /// One epoch over `data` in shuffled batches; `progress(batches_done,
    /// graphs_done, loss)` is called after each batch. Returns the mean loss
    /// of the batches applied. A batch whose loss or a gradient is not
    /// finite is never applied: it stops the epoch with
    /// [`ExecError::NonFinite`] naming the batch, or with
    /// [`OnNonFinite::SkipBatch`] counts in [`Trainer::skipped`].
    pub fn train_epoch(
        &mut self,
        data: &[InputGraph],
        batch_size: usize,
        rng: &mut ChaCha8Rng,
        progress: impl FnMut(usize, usize, f64),
    ) -> Result<f64> {
        self.train_epoch_progress(data, batch_size, rng, progress)
            .map(|at| at.mean_loss())
    }

    /// [`Trainer::train_epoch`], returning the epoch's whole progress (the
    /// batches skipped for a non-finite step among it).
    pub fn train_epoch_progress(
        &mut self,
        data: &[InputGraph],
        batch_size: usize,
        rng: &mut ChaCha8Rng,
        progress: impl FnMut(usize, usize, f64),
    ) -> Result<EpochProgress> {
        let order = shuffled_order(data.len(), rng);
        let mut at = EpochProgress::default();
        let span = Span {
            data,
            order: &order,
            batch_size,
            rates: None,
        };
        self.train_span(&span, &mut at, &Pauses::default(), progress)?;
        Ok(at)
    }

    /// Trains on the batches of `span` from batch `at.batches` on, until
    /// the epoch ends or `pauses` says to pause; `at` counts the batches,
    /// graphs and loss, `progress(batches_done, graphs_done, loss)` is
    /// called after each batch. When it returns, every step submitted has
    /// finished, so [`Trainer::state`] reads the state to save (the dropout
    /// stream included: an engine that prepares batches ahead is never
    /// ahead of `at`). The batches are built on another thread one window
    /// ahead of the engine, so the host schedules window `k + 1` while the
    /// engine trains window `k`.
    pub fn train_span(
        &mut self,
        span: &Span<'_>,
        at: &mut EpochProgress,
        pauses: &Pauses<'_>,
        mut progress: impl FnMut(usize, usize, f64),
    ) -> Result<SpanEnd> {
        if span.batch_size == 0 {
            return Err(ExecError::Config("batch size must be at least 1".into()));
        }
        self.check_nonfinite_policy()?;
        // trained with other ranks: this rank's part of each global batch
        // (possibly empty in a short last one)
        let (rank, world) = self.engine.ranks();
        let chunks: Vec<&[usize]> = match world {
            1 => span.order.chunks(span.batch_size).collect(),
            _ => Shard::new(rank, world).and_then(|s| s.batches(span.order, span.batch_size))?,
        };
        // and every rank's graphs of each batch, for its step's plan
        let k = self.accumulate.max(1);
        if k > 1 && !self.engine.takes_step_plans() {
            return Err(ExecError::Config(format!(
                "the {} engine takes one batch a step: accumulating {k} needs a \
                 data-parallel one",
                self.engine.name()
            )));
        }
        let steps: Vec<&[usize]> = match self.engine.takes_step_plans() {
            false => Vec::new(),
            true => span.order.chunks(span.batch_size * world).collect(),
        };
        // windows of whole steps
        if !at.batches.is_multiple_of(k) || pauses.every.is_some_and(|n| !n.is_multiple_of(k)) {
            return Err(ExecError::Config(format!(
                "with {k} batches a step, a run pauses and resumes only between steps \
                 (at batch {} of the epoch, pauses every {:?} batches)",
                at.batches, pauses.every
            )));
        }
        let window = self.engine.lookahead().max(1).div_ceil(k) * k;
        let windows = windows(at.batches, chunks.len(), window, pauses.every);
        let model = self.engine.model().clone();
        let (sender, built) = std::sync::mpsc::sync_channel(1);
        let producer = Producer {
            model: &model,
            policy: self.policy,
            data: span.data,
            chunks: &chunks,
            steps: &steps,
            accumulate: k,
        };
        std::thread::scope(|scope| {
            scope.spawn(|| producer.run(&windows, sender));
            let end = self.consume(span, at, (&windows, built), pauses, &mut progress);
            // the producer stops at its next window once `built` is gone
            end
        })
    }

    /// The engine's side of [`train_span`](Self::train_span): submits each
    /// window `built` hands over (its batches, `None` for a rank's empty
    /// share) and counts the outcomes.
    fn consume(
        &mut self,
        span: &Span<'_>,
        at: &mut EpochProgress,
        (windows, built): (&[std::ops::Range<usize>], Receiver<'_>),
        pauses: &Pauses<'_>,
        progress: &mut impl FnMut(usize, usize, f64),
    ) -> Result<SpanEnd> {
        // size and first graph of the batches whose outcomes have not come
        // back (an overlapping engine returns each a batch or more later)
        let mut in_flight = VecDeque::new();
        let mut end = SpanEnd::EpochDone;
        for (i, group) in windows.iter().enumerate() {
            let (batches, plans, sizes) = built
                .recv()
                .map_err(|_| ExecError::Config("the batch builder stopped".into()))??;
            if !plans.is_empty() {
                self.engine.set_step_plans(plans)?;
            }
            // one outcome a step: its batches' graphs (this rank's, every
            // rank's), first graph and count
            let k = self.accumulate.max(1);
            for (j, step) in batches.chunks(k).enumerate() {
                let graphs = step.iter().flatten().map(|b| b.batch.graphs.len()).sum();
                let all = match sizes.is_empty() {
                    true => graphs,
                    false => sizes.iter().skip(j * k).take(step.len()).sum(),
                };
                let first = step.iter().flatten().next().map_or(0, |b| b.first);
                in_flight.push_back(InFlight {
                    graphs,
                    all,
                    first,
                    batches: step.len(),
                });
            }
            let outcomes = match batches.iter().all(Option::is_some) {
                true => {
                    if let Some(rate) = span.rates {
                        let lrs: Vec<f64> = group.clone().map(rate).collect();
                        self.engine.set_step_lrs(&lrs)?;
                    }
                    let batches: Vec<Batch> =
                        batches.into_iter().flatten().map(|b| b.batch).collect();
                    self.engine.submit(&batches)?
                }
                false => {
                    let mut outcomes = Vec::new();
                    for (b, step) in batches.into_iter().zip(group.clone()) {
                        if let Some(rate) = span.rates {
                            self.engine.set_step_lrs(&[rate(step)])?;
                        }
                        outcomes.extend(match b {
                            Some(b) => self.engine.submit(std::slice::from_ref(&b.batch))?,
                            None => self.engine.submit_idle()?,
                        });
                    }
                    outcomes
                }
            };
            for outcome in outcomes {
                self.count(at, outcome, &mut in_flight, span, progress)?;
            }
            if i + 1 == windows.len() {
                break;
            }
            if pauses
                .every
                .is_some_and(|n| n > 0 && group.end.is_multiple_of(n))
            {
                end = SpanEnd::Checkpoint;
                break;
            }
            if self.stop_requested(pauses, i)? {
                end = SpanEnd::Requested;
                break;
            }
        }
        for outcome in self.engine.finish()? {
            self.count(at, outcome, &mut in_flight, span, progress)?;
        }
        Ok(end)
    }

    /// Whether to pause for a stop request after window `i` of a span:
    /// alone, as the request says; with other ranks, their requests summed
    /// every [`AGREE_EVERY`] windows, so that every rank pauses at the same
    /// batch (one that paused alone would leave the others waiting at
    /// their next step).
    fn stop_requested(&mut self, pauses: &Pauses<'_>, i: usize) -> Result<bool> {
        let asked = (pauses.requested)();
        if self.engine.ranks().1 == 1 {
            return Ok(asked);
        }
        if !(i + 1).is_multiple_of(AGREE_EVERY) {
            return Ok(false);
        }
        let mut any = [f64::from(u8::from(asked))];
        self.engine.sum_over_ranks(&mut any)?;
        Ok(any[0] > 0.0)
    }

    /// Adds one step's outcome (of the oldest step in `in_flight`: its
    /// graphs, first graph and batches) to the epoch's progress, or stops
    /// on a non-finite one.
    fn count(
        &mut self,
        at: &mut EpochProgress,
        outcome: StepOutcome,
        in_flight: &mut VecDeque<InFlight>,
        span: &Span<'_>,
        progress: &mut impl FnMut(usize, usize, f64),
    ) -> Result<()> {
        let InFlight {
            graphs,
            all,
            first,
            batches,
        } = in_flight.pop_front().unwrap_or_default();
        at.batches += batches.max(1);
        at.graphs += graphs;
        let loss = match outcome {
            Ok(loss) => {
                at.loss_sum += loss * all as f64;
                at.applied += all;
                loss
            }
            Err(step)
                if self.on_nonfinite == OnNonFinite::SkipBatch && !step.values_nonfinite() =>
            {
                at.skipped += 1;
                step.loss
            }
            Err(step) => {
                let place = BatchPlace {
                    batch: at.batches,
                    batches: span
                        .order
                        .len()
                        .div_ceil(span.batch_size * self.engine.ranks().1),
                    first_graph: span
                        .data
                        .get(first)
                        .map_or_else(String::new, |g| g.describe(first)),
                };
                return Err(ExecError::NonFinite(Box::new(NonFiniteFault {
                    step,
                    place: Some(place),
                })));
            }
        };
        progress(at.batches, at.graphs, loss);
        Ok(())
    }

    /// Loss, root accuracy and all-node accuracy over `data`.
    pub fn evaluate(&mut self, data: &[InputGraph], batch_size: usize) -> Result<EvalResult> {
        evaluate(self.engine.as_mut(), self.policy, data, batch_size)
    }
}

/// Loss, root accuracy and all-node accuracy of `engine`'s current
/// parameters over `data`.
pub fn evaluate<T: Real>(
    engine: &mut dyn TrainEngine<T>,
    policy: BatchingPolicy,
    data: &[InputGraph],
    batch_size: usize,
) -> Result<EvalResult> {
    // the ranks' running statistics, the same on every rank
    engine.sync_buffers()?;
    let head_rows = engine.model().head.rows;
    let (mut loss, mut root_ok, mut node_ok, mut nodes) = (0.0, 0usize, 0usize, 0usize);
    let mut roots = 0usize;
    // with other ranks: every rank its share of the batches, then the sums
    let (rank, world) = engine.ranks();
    let chunks = data.chunks(batch_size.max(1)).enumerate();
    for (_, chunk) in chunks.filter(|(i, _)| i % world == rank) {
        let graphs: Vec<&InputGraph> = chunk.iter().collect();
        let batch = Batch::new(engine.model(), graphs, policy)?;
        let s = &batch.schedule;
        let out = engine.forward(&batch, Mode::Evaluate)?;
        loss += out.loss.unwrap_or(0.0) * chunk.len() as f64;
        let all = match head_rows {
            HeadRows::Labelled => out,
            HeadRows::Roots => {
                let preds = out.predictions();
                for (&v, &p) in out.head_vertices.iter().zip(&preds) {
                    let label = s.labels[v as usize];
                    roots += usize::from(label != NO_LABEL);
                    root_ok += usize::from(label == p as i32);
                }
                engine.forward_rows(&batch, Mode::Infer, HeadRows::Labelled)?
            }
        };
        let preds = all.predictions();
        let mut is_root = vec![false; s.num_vertices()];
        s.roots.iter().for_each(|&r| is_root[r as usize] = true);
        for (&v, &p) in all.head_vertices.iter().zip(&preds) {
            let ok = s.labels[v as usize] == p as i32;
            node_ok += ok as usize;
            nodes += 1;
            if head_rows == HeadRows::Labelled && is_root[v as usize] {
                roots += 1;
                root_ok += ok as usize;
            }
        }
    }
    let mut sums = [
        loss,
        root_ok as f64,
        roots as f64,
        node_ok as f64,
        nodes as f64,
    ];
    engine.sum_over_ranks(&mut sums)?;
    let [loss, root_ok, roots, node_ok, nodes] = sums;
    let n = data.len().max(1) as f64;
    Ok(EvalResult {
        loss: loss / n,
        root_accuracy: root_ok / roots.max(1.0),
        node_accuracy: node_ok / nodes.max(1.0),
        graphs: data.len(),
    })
}

/// A reproducible shuffling stream.
pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// An epoch's order of `len` graphs, drawn from `rng`.
pub fn shuffled_order(len: usize, rng: &mut ChaCha8Rng) -> Vec<usize> {
    let mut order: Vec<usize> = (0..len).collect();
    order.shuffle(rng);
    order
}

/// How far an epoch has got: batches trained (applied or skipped), this
/// rank's graphs in them, the graphs of the steps applied (every rank's)
/// and the sum of their losses weighted by those graphs, and the steps
/// skipped for a non-finite loss or gradient.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EpochProgress {
    pub batches: usize,
    pub graphs: usize,
    pub applied: usize,
    pub loss_sum: f64,
    pub skipped: usize,
    /// Graphs at the start of the epoch's order that a run on another
    /// number of ranks trained before it was resumed: `batches` counts
    /// from there ([`RunState::rebase`](crate::resume::RunState::rebase)).
    pub skip: usize,
}

impl EpochProgress {
    /// The epoch's mean loss per graph of the batches applied so far.
    pub fn mean_loss(&self) -> f64 {
        self.loss_sum / self.applied.max(1) as f64
    }
}

/// Windows between two agreements of the ranks on a stop request (see
/// [`Trainer::train_span`]): a sum over the ranks waits for the device, so
/// not after every step.
pub const AGREE_EVERY: usize = 8;

/// The windows (ranges of batch indices) from batch `first` to `count`:
/// `window` batches each, none crossing a multiple of `every`.
fn windows(
    first: usize,
    count: usize,
    window: usize,
    every: Option<usize>,
) -> Vec<std::ops::Range<usize>> {
    let every = every.filter(|&n| n > 0);
    let mut out = Vec::new();
    let mut next = first;
    while next < count {
        let mut stop = (next + window).min(count);
        if let Some(n) = every {
            stop = stop.min((next / n + 1) * n);
        }
        out.push(next..stop);
        next = stop;
    }
    out
}

/// A step whose outcome has not come back: this rank's graphs in it,
/// every rank's, its first graph (for a located error) and its batches.
#[derive(Clone, Copy, Debug, Default)]
struct InFlight {
    graphs: usize,
    all: usize,
    first: usize,
    batches: usize,
}

/// A batch built ahead, with its first graph's index (for a located error).
struct Built<'a> {
    batch: Batch<'a>,
    first: usize,
}

/// A window of built batches (`None`: a rank's empty share of a global
/// batch) with, on several ranks or accumulating, each one's step plan and
/// every rank's graphs in it; or the error that stopped the builder.
type Window<'a> = Result<(Vec<Option<Built<'a>>>, Vec<StepPlan>, Vec<usize>)>;

/// Where the engine's side receives windows from the builder.
type Receiver<'a> = std::sync::mpsc::Receiver<Window<'a>>;

/// The builder's side of [`Trainer::train_span`]: schedules each window's
/// batches (in parallel) and hands them over in order, with their steps'
/// plans when other ranks train too.
struct Producer<'s, 'a> {
    model: &'s Model,
    policy: BatchingPolicy,
    data: &'a [InputGraph],
    /// This rank's batches.
    chunks: &'s [&'s [usize]],
    /// Every rank's graphs of each batch (empty when training alone
    /// without accumulation).
    steps: &'s [&'s [usize]],
    /// Batches a step.
    accumulate: usize,
}

impl<'a> Producer<'_, 'a> {
    fn run(&self, windows: &[std::ops::Range<usize>], sender: SyncSender<Window<'a>>) {
        for group in windows {
            let built = self.chunks[group.clone()]
                .par_iter()
                .with_max_len(1)
                .map(|chunk| self.build(chunk))
                .collect::<Result<Vec<_>>>()
                .and_then(|built| {
                    Ok((built, self.plans(group.clone())?, self.sizes(group.clone())))
                });
            let failed = built.is_err();
            // a send fails once the engine's side stopped: nothing to do
            if sender.send(built).is_err() || failed {
                return;
            }
        }
    }

    /// The graphs of every rank in batches `group` (none when training
    /// alone without accumulation).
    fn sizes(&self, group: std::ops::Range<usize>) -> Vec<usize> {
        self.steps
            .get(group)
            .map_or_else(Vec::new, |b| b.iter().map(|s| s.len()).collect())
    }

    /// The plans of batches `group` (whole steps; none when training
    /// alone without accumulation): each its step's.
    fn plans(&self, group: std::ops::Range<usize>) -> Result<Vec<StepPlan>> {
        let Some(batches) = self.steps.get(group) else {
            return Ok(Vec::new());
        };
        let plans: Vec<StepPlan> = batches
            .par_chunks(self.accumulate)
            .map(|step| {
                let graphs: Vec<&InputGraph> = step
                    .iter()
                    .flat_map(|b| b.iter().map(|&i| &self.data[i]))
                    .collect();
                StepPlan::of(self.model, &graphs)
            })
            .collect::<Result<_>>()?;
        let mut out = Vec::with_capacity(batches.len());
        for (plan, step) in plans.into_iter().zip(batches.chunks(self.accumulate)) {
            // the step's earlier batches take copies, its last the plan
            if step.len() > 1 {
                let earlier = StepPlan {
                    last: false,
                    ..plan.clone()
                };
                out.extend(std::iter::repeat_n(earlier, step.len() - 1));
            }
            out.push(plan);
        }
        Ok(out)
    }

    fn build(&self, chunk: &[usize]) -> Result<Option<Built<'a>>> {
        let Some(&first) = chunk.first() else {
            return Ok(None);
        };
        let graphs: Vec<&InputGraph> = chunk.iter().map(|&i| &self.data[i]).collect();
        Ok(Some(Built {
            batch: Batch::new(self.model, graphs, self.policy)?,
            first,
        }))
    }
}

/// An epoch's batches: `order` (indices into `data`) cut into batches of
/// `batch_size`, and the learning rate of each.
pub struct Span<'a> {
    pub data: &'a [InputGraph],
    pub order: &'a [usize],
    pub batch_size: usize,
    /// The learning rate of the epoch's batch `i` (from 0; a schedule,
    /// see [`crate::schedule`]), set before its step; `None`: the engine's
    /// rate stays.
    pub rates: Option<&'a dyn Fn(usize) -> f64>,
}

/// Where [`Trainer::train_span`] pauses.
pub struct Pauses<'a> {
    /// After every this many batches of the epoch (a checkpoint).
    pub every: Option<usize>,
    /// Asked after every window of batches: pause there if it says so (an
    /// interrupted run).
    pub requested: &'a dyn Fn() -> bool,
}

impl Default for Pauses<'_> {
    fn default() -> Self {
        Pauses {
            every: None,
            requested: &|| false,
        }
    }
}

/// Why [`Trainer::train_span`] returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanEnd {
    /// The epoch's last batch is done.
    EpochDone,
    /// A multiple of [`Pauses::every`] batches is done.
    Checkpoint,
    /// [`Pauses::requested`] said to pause.
    Requested,
}

#[cfg(test)]
mod tests {
    use super::windows;

    #[test]
    fn windows_cover_the_rest_of_the_epoch_and_never_cross_a_checkpoint() {
        assert_eq!(windows(0, 7, 3, None), vec![0..3, 3..6, 6..7]);
        assert_eq!(windows(2, 7, 3, None), vec![2..5, 5..7]);
        assert_eq!(windows(0, 7, 3, Some(4)), vec![0..3, 3..4, 4..7]);
        assert_eq!(windows(5, 9, 2, Some(3)), vec![5..6, 6..8, 8..9]);
        assert_eq!(windows(0, 3, 1, Some(0)), vec![0..1, 1..2, 2..3]);
        assert!(windows(7, 7, 3, None).is_empty());
    }
}
