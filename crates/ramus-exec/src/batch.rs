//! What every engine takes and returns for one batch: the batch itself with
//! its schedule ([`Batch`]), the pass's [`Mode`], the [`ForwardOutput`], the
//! row runs ops are run over ([`Range`]), and the batch's inputs beside its
//! graphs (dropout masks drawn the same way by every engine, pulled values).

use ramus_core::graph::Space;
use ramus_core::{Model, Real};
use ramus_graph::{BatchingPolicy, FunctionRows, InputGraph, Schedule, Task};

use rand::Rng;
use rand_chacha::ChaCha8Rng;

use crate::error::{ExecError, Result};

/// A batch of input graphs with its schedule.
pub struct Batch<'a> {
    pub graphs: Vec<&'a InputGraph>,
    pub schedule: Schedule,
}

impl<'a> Batch<'a> {
    /// Schedules `graphs` for `model` under `policy`; a vertex the model
    /// cannot run as it is ([`Model::function_for`]: e.g. three children
    /// for a binary cell) is an error naming the graph's place and the vertex.
    pub fn new(model: &Model, graphs: Vec<&'a InputGraph>, policy: BatchingPolicy) -> Result<Self> {
        let schedule = Schedule::build(&graphs, policy, model.functions.len(), |kind, k| {
            model.function_for(kind, k)
        })?;
        Ok(Batch { graphs, schedule })
    }
    /// Number of graphs.
    pub fn len(&self) -> usize {
        self.graphs.len()
    }
    pub fn is_empty(&self) -> bool {
        self.graphs.is_empty()
    }
}

/// Whether a forward pass computes the loss (needs labels) or only scores,
/// and whether dropout is active.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Loss and scores with dropout active; a backward pass may follow.
    Train,
    /// Loss and scores without dropout (evaluation).
    Evaluate,
    /// Scores only (no labels needed), without dropout.
    Infer,
}

/// What a forward pass returns.
#[derive(Clone, Debug)]
pub struct ForwardOutput<T> {
    /// Mean loss over head rows (train mode).
    pub loss: Option<f64>,
    /// Vertex number of every head row.
    pub head_vertices: Vec<u32>,
    /// Scores, `head_vertices.len() × classes` (if the head declares logits).
    pub logits: Vec<T>,
    pub classes: usize,
}

impl<T: Real> ForwardOutput<T> {
    /// Argmax class of each head row.
    pub fn predictions(&self) -> Vec<u32> {
        if self.classes == 0 {
            return Vec::new();
        }
        self.logits
            .chunks(self.classes)
            .map(|row| {
                let mut best = 0;
                for (i, &v) in row.iter().enumerate() {
                    if v > row[best] {
                        best = i;
                    }
                }
                best as u32
            })
            .collect()
    }
}

/// A contiguous run of a vertex function's rows and edge rows: one task,
/// every row, or the head's rows. Engines run ops over such runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Range {
    pub r0: usize,
    pub r1: usize,
    pub e0: usize,
    pub e1: usize,
}

impl Range {
    /// Every row and edge of a vertex function.
    pub fn all(rows: &FunctionRows) -> Self {
        Range {
            r0: 0,
            r1: rows.rows(),
            e0: 0,
            e1: rows.edges(),
        }
    }
    /// The rows and edges of one task.
    pub fn task(t: &Task) -> Self {
        Range {
            r0: t.row_offset as usize,
            r1: (t.row_offset + t.len) as usize,
            e0: t.edge_offset as usize,
            e1: (t.edge_offset + t.edge_len) as usize,
        }
    }
    /// `rows` vertex rows and no edges (the head's rows).
    pub fn rows_only(rows: usize) -> Self {
        Range {
            r0: 0,
            r1: rows,
            e0: 0,
            e1: 0,
        }
    }
    /// First and one-past-last row of `space` in this run (static values
    /// are one row).
    pub fn span(&self, space: Space) -> (usize, usize) {
        match space {
            Space::Vertex => (self.r0, self.r1),
            Space::Edge => (self.e0, self.e1),
            Space::Static => (0, 1),
        }
    }
}

/// Fills one dropout mask: Bernoulli keep masks scaled by `1 / (1 - rate)`
/// while training (`rate_units` in 1e-4, one draw per element from `rng`),
/// ones otherwise. Every engine draws masks through this, in the same order
/// (functions' forward graphs, then the head), so their results agree.
pub fn fill_dropout_mask<T: Real>(
    out: &mut [T],
    rate_units: u16,
    training: bool,
    rng: &mut ChaCha8Rng,
) {
    let rate = f64::from(rate_units) * 1e-4;
    let keep = T::from_f64(1.0 / (1.0 - rate));
    for x in out.iter_mut() {
        *x = if !training {
            T::ONE
        } else if rng.random::<f64>() < rate {
            T::ZERO
        } else {
            keep
        };
    }
}

/// Checks the values a `pull(width)` reads for a batch: explicit pull
/// values (`explicit`) or the graphs' own features, `width` floats per
/// vertex number.
pub fn pulled_values<'a, T>(
    values: &'a [T],
    s: &Schedule,
    width: usize,
    function: &str,
    explicit: bool,
) -> Result<&'a [T]> {
    if !explicit && s.feature_width != width {
        return Err(ExecError::Input(if s.feature_width == 0 {
            format!(
                "vertex function `{function}` pulls {width} floats per vertex, but the graphs carry no features and no pull values were supplied"
            )
        } else {
            format!(
                "vertex function `{function}` pulls {width} floats per vertex, but the graphs carry {} features per vertex",
                s.feature_width
            )
        }));
    }
    if values.len() != s.num_vertices() * width {
        return Err(ExecError::Input(format!(
            "pull values hold {} floats, expected {} vertices x {width}",
            values.len(),
            s.num_vertices()
        )));
    }
    Ok(values)
}
