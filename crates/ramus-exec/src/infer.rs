//! The inference contract: every engine that scores graphs (the CPU and
//! CUDA compiled engines, the batched engines through [`BatchedInfer`], the
//! measuring chooser [`crate::auto::AutoInfer`]) is an [`InferEngine`],
//! built for one model with its parameters, so a command or a library user
//! runs any of them the same way.
//!
//! ```
//! use ramus_exec::{InferEngine, Scores};
//! use ramus_graph::InputGraph;
//!
//! // An engine is anything that scores a batch of graphs; this one gives
//! // every graph the scores [vertices, 0].
//! struct Count;
//! impl InferEngine<f32> for Count {
//!     fn name(&self) -> &'static str {
//!         "count"
//!     }
//!     fn infer(&mut self, graphs: &[&InputGraph]) -> ramus_exec::Result<Scores<f32>> {
//!         let values = graphs.iter().flat_map(|g| [g.len() as f32, 0.0]).collect();
//!         Ok(Scores { values, classes: 2 })
//!     }
//! }
//!
//! let mut leaf = InputGraph::new();
//! leaf.push_vertex(&[], 0, 0).unwrap();
//! let mut engine: Box<dyn InferEngine<f32>> = Box::new(Count);
//! let scores = engine.infer(&[&leaf, &leaf]).unwrap();
//! assert_eq!(scores.rows().count(), 2);
//! assert_eq!(scores.predictions(), vec![0, 0]);
//! ```

use ramus_core::{HeadRows, Real};
use ramus_graph::{BatchingPolicy, InputGraph};

use crate::batch::{Batch, Mode};
use crate::engine::TrainEngine;
use crate::error::Result;

/// Scores of one batch: a row of `classes` scores per root, roots graph by
/// graph in the order of the batch's graphs (one row per graph for trees).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Scores<T> {
    /// `rows × classes` scores, row-major.
    pub values: Vec<T>,
    pub classes: usize,
}

impl<T: Real> Scores<T> {
    /// The rows of scores, one per root.
    pub fn rows(&self) -> std::slice::Chunks<'_, T> {
        self.values.chunks(self.classes.max(1))
    }

    /// The highest-scoring class of each row (the first of equals).
    pub fn predictions(&self) -> Vec<usize> {
        self.rows()
            .map(|row| {
                let mut best = 0;
                for (c, &x) in row.iter().enumerate() {
                    if x > row[best] {
                        best = c;
                    }
                }
                best
            })
            .collect()
    }
}

/// An inference engine built for one model with its parameters: it scores
/// the roots of a batch of graphs.
pub trait InferEngine<T: Real> {
    /// Short name for reports, e.g. `cpu-compiled`.
    fn name(&self) -> &'static str;

    /// Scores every root of `graphs` (see [`Scores`]). A graph the model
    /// cannot run is an error naming the graph's place and the vertex.
    fn infer(&mut self, graphs: &[&InputGraph]) -> Result<Scores<T>>;
}

/// A batched engine ([`TrainEngine`], built for one model with its
/// parameters) as an [`InferEngine`]: each batch is scheduled by
/// [`BatchingPolicy::Cavs`] (as training does) and run forward in
/// [`Mode::Infer`] with the head on the roots, on the engine's current
/// parameters.
pub struct BatchedInfer<'a, T: Real> {
    engine: Box<dyn TrainEngine<T> + 'a>,
}

impl<'a, T: Real> BatchedInfer<'a, T> {
    /// Inference through `engine`.
    pub fn new(engine: Box<dyn TrainEngine<T> + 'a>) -> Self {
        BatchedInfer { engine }
    }
}

impl<T: Real> InferEngine<T> for BatchedInfer<'_, T> {
    fn name(&self) -> &'static str {
        self.engine.name()
    }

    fn infer(&mut self, graphs: &[&InputGraph]) -> Result<Scores<T>> {
        let batch = Batch::new(self.engine.model(), graphs.to_vec(), BatchingPolicy::Cavs)?;
        let out = self
            .engine
            .forward_rows(&batch, Mode::Infer, HeadRows::Roots)?;
        Ok(Scores {
            values: out.logits,
            classes: out.classes,
        })
    }
}
