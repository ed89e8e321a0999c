//! Training and evaluation loops over any [`Engine`] (the CPU batched
//! engine by default).

use std::collections::VecDeque;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use ramus_core::{Grads, HeadRows, Model, Params, Real};
use ramus_cpu::{Batch, CpuEngine, Mode};

use crate::engine::Engine;
use ramus_graph::{BatchingPolicy, InputGraph, NO_LABEL};

use crate::error::{NnError, Result};
use crate::optim::{Optimizer, OptimizerConfig};

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

/// A model, its parameters, gradients, optimizer state and engine.
pub struct Trainer<T> {
    pub model: Model,
    pub params: Params<T>,
    pub grads: Grads<T>,
    pub optimizer: Optimizer<T>,
    pub engine: Box<dyn Engine<T>>,
    pub policy: BatchingPolicy,
}

impl<T: Real> Trainer<T> {
    pub fn new(model: Model, params: Params<T>, config: OptimizerConfig) -> Self {
        let grads = Grads::zeros(&model);
        let optimizer = Optimizer::new(config, &params);
        Trainer {
            model,
            params,
            grads,
            optimizer,
            engine: Box::new(CpuEngine::new()),
            policy: BatchingPolicy::Cavs,
        }
    }

    /// Forward, backward and one optimizer step on `graphs`; returns the
    /// loss. On a device engine `self.params` lags until [`Trainer::sync_params`]
    /// (which [`Trainer::train_epoch`] calls at the end of each epoch).
    pub fn train_batch(&mut self, graphs: &[&InputGraph]) -> Result<f64> {
        let batch = Batch::new(&self.model, graphs.to_vec(), self.policy)?;
        self.engine.train_step(
            &self.model,
            &mut self.params,
            &mut self.grads,
            &mut self.optimizer,
            &batch,
        )
    }

    /// Brings `self.params` up to date with the engine's copy.
    pub fn sync_params(&mut self) -> Result<()> {
        self.engine.sync_host_params(&mut self.params)
    }

    /// One epoch over `data` in shuffled batches; `progress(batches_done,
    /// graphs_done, loss)` is called after each batch. Returns the mean loss.
    pub fn train_epoch(
        &mut self,
        data: &[InputGraph],
        batch_size: usize,
        rng: &mut ChaCha8Rng,
        progress: impl FnMut(usize, usize, f64),
    ) -> Result<f64> {
        let order = shuffled_order(data.len(), rng);
        let mut at = EpochProgress::default();
        let span = Span {
            data,
            order: &order,
            batch_size,
        };
        self.train_span(&span, &mut at, &Pauses::default(), progress)?;
        Ok(at.mean_loss())
    }

    /// Trains on the batches of `span` from batch `at.batches` on, until
    /// the epoch ends or `pauses` says to pause; `at` counts the batches,
    /// graphs and loss, `progress(batches_done, graphs_done, loss)` is
    /// called after each batch. When it returns, every step submitted has
    /// finished and `self.params` is up to date, so the state can be saved
    /// (the dropout stream included: an engine that prepares batches ahead
    /// is never ahead of `at`).
    pub fn train_span(
        &mut self,
        span: &Span<'_>,
        at: &mut EpochProgress,
        pauses: &Pauses<'_>,
        mut progress: impl FnMut(usize, usize, f64),
    ) -> Result<SpanEnd> {
        if span.batch_size == 0 {
            return Err(NnError::Config("batch size must be at least 1".into()));
        }
        let chunks: Vec<&[usize]> = span.order.chunks(span.batch_size).collect();
        // sizes of the batches whose losses have not come back (an
        // overlapping engine returns each loss a batch later)
        let mut in_flight = VecDeque::new();
        // an engine that prepares batches ahead gets them a window at a
        // time (scheduled in parallel), a window never crossing a pause
        let window = self.engine.lookahead().max(1);
        let every = pauses.every.filter(|&n| n > 0);
        let mut next = at.batches;
        let end = loop {
            if next >= chunks.len() {
                break SpanEnd::EpochDone;
            }
            let mut stop = (next + window).min(chunks.len());
            if let Some(n) = every {
                stop = stop.min((next / n + 1) * n);
            }
            let group = &chunks[next..stop];
            let build = |chunk: &&[usize]| {
                let graphs: Vec<&InputGraph> = chunk.iter().map(|&i| &span.data[i]).collect();
                Batch::new(&self.model, graphs, self.policy)
            };
            let batches = group
                .par_iter()
                .with_max_len(1)
                .map(build)
                .collect::<ramus_cpu::Result<Vec<Batch>>>()?;
            in_flight.extend(group.iter().map(|c| c.len()));
            let losses = self.engine.submit_train_steps(
                &self.model,
                &mut self.params,
                &mut self.grads,
                &mut self.optimizer,
                &batches,
            )?;
            at.add(&mut in_flight, losses, &mut progress);
            next = stop;
            if next >= chunks.len() {
                break SpanEnd::EpochDone;
            }
            if every.is_some_and(|n| next.is_multiple_of(n)) {
                break SpanEnd::Checkpoint;
            }
            if (pauses.requested)() {
                break SpanEnd::Requested;
            }
        };
        at.add(
            &mut in_flight,
            self.engine.finish_train_steps()?,
            &mut progress,
        );
        self.sync_params()?;
        Ok(end)
    }

    /// Loss, root accuracy and all-node accuracy over `data`.
    pub fn evaluate(&mut self, data: &[InputGraph], batch_size: usize) -> Result<EvalResult> {
        evaluate(
            &self.model,
            &self.params,
            self.engine.as_mut(),
            self.policy,
            data,
            batch_size,
        )
    }
}

/// Loss, root accuracy and all-node accuracy of `params` over `data`.
pub fn evaluate<T: Real>(
    model: &Model,
    params: &Params<T>,
    engine: &mut dyn Engine<T>,
    policy: BatchingPolicy,
    data: &[InputGraph],
    batch_size: usize,
) -> Result<EvalResult> {
    let (mut loss, mut root_ok, mut node_ok, mut nodes) = (0.0, 0usize, 0usize, 0usize);
    let mut roots = 0usize;
    for chunk in data.chunks(batch_size.max(1)) {
        let graphs: Vec<&InputGraph> = chunk.iter().collect();
        let batch = Batch::new(model, graphs, policy)?;
        let s = &batch.schedule;
        let out = engine.forward(model, params, &batch, Mode::Evaluate)?;
        loss += out.loss.unwrap_or(0.0) * chunk.len() as f64;
        let all = match model.head.rows {
            HeadRows::Labelled => out,
            HeadRows::Roots => {
                let preds = out.predictions();
                for (&v, &p) in out.head_vertices.iter().zip(&preds) {
                    let label = s.labels[v as usize];
                    roots += usize::from(label != NO_LABEL);
                    root_ok += usize::from(label == p as i32);
                }
                engine.forward_rows(model, params, &batch, Mode::Infer, HeadRows::Labelled)?
            }
        };
        let preds = all.predictions();
        let mut is_root = vec![false; s.num_vertices()];
        s.roots.iter().for_each(|&r| is_root[r as usize] = true);
        for (&v, &p) in all.head_vertices.iter().zip(&preds) {
            let ok = s.labels[v as usize] == p as i32;
            node_ok += ok as usize;
            nodes += 1;
            if model.head.rows == HeadRows::Labelled && is_root[v as usize] {
                roots += 1;
                root_ok += ok as usize;
            }
        }
    }
    let n = data.len().max(1) as f64;
    Ok(EvalResult {
        loss: loss / n,
        root_accuracy: root_ok as f64 / roots.max(1) as f64,
        node_accuracy: node_ok as f64 / nodes.max(1) as f64,
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

/// How far an epoch has got: batches trained, graphs in them, and the
/// sum of their losses weighted by graphs.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EpochProgress {
    pub batches: usize,
    pub graphs: usize,
    pub loss_sum: f64,
}

impl EpochProgress {
    /// The epoch's mean loss per graph so far.
    pub fn mean_loss(&self) -> f64 {
        self.loss_sum / self.graphs.max(1) as f64
    }

    /// Counts the batches whose `losses` came back, oldest first, their
    /// sizes taken from `in_flight`.
    fn add(
        &mut self,
        in_flight: &mut VecDeque<usize>,
        losses: Vec<f64>,
        progress: &mut impl FnMut(usize, usize, f64),
    ) {
        for loss in losses {
            let n = in_flight.pop_front().unwrap_or(0);
            self.loss_sum += loss * n as f64;
            self.graphs += n;
            self.batches += 1;
            progress(self.batches, self.graphs, loss);
        }
    }
}

/// An epoch's batches: `order` (indices into `data`) cut into batches of
/// `batch_size`.
pub struct Span<'a> {
    pub data: &'a [InputGraph],
    pub order: &'a [usize],
    pub batch_size: usize,
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
