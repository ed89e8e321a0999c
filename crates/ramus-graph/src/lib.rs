//! Ramus input graphs: the per-sample structures (trees, chains, DAGs) that
//! vertex functions are evaluated over, the readers that build them from
//! files (PTB brackets, plain text, tagged text), the sequence models'
//! graph shapes (BiLSTM taggers, time-delay pyramids), the vocabulary, the built-in synthetic treebank and images, and the batch
//! schedules (Cavs batching policy, DyNet agenda) that execution engines run,
//! and the linearizer of the compiled (Cortex) engine.
//!
//! ```
//! use ramus_graph::{ptb, synthetic, BatchingPolicy, Schedule, Vocab, VocabMode};
//!
//! # fn main() -> Result<(), ramus_graph::GraphError> {
//! // Labelled trees in PTB brackets (the Stanford Sentiment Treebank's
//! // format), one a line; the vocabulary grows with the words it meets.
//! let mut vocab = Vocab::new();
//! let text = "(1 (2 not) (3 good))\n(0 (2 very) (1 (2 not) (3 good)))";
//! let trees = ptb::parse_trees(text, "<example>", VocabMode::Grow(&mut vocab))?;
//! // vertices in post-order: children before parents, the root last
//! assert_eq!(trees[0].len(), 3);
//! assert_eq!(trees[0].roots(), vec![2]);
//! assert_eq!(trees[1].root_label(), Some(0));
//! assert_eq!(vocab.get("good"), Some(trees[0].tokens[1]));
//!
//! // The built-in synthetic treebank is in the same format; read with the
//! // vocabulary frozen, unknown words are `<unk>`.
//! let tb = synthetic::generate(synthetic::DEFAULT_SEED, (20, 5, 5));
//! let dev = ptb::parse_trees(&tb.dev.join("\n"), "dev", VocabMode::Frozen(&vocab))?;
//! assert_eq!(dev.len(), 5);
//!
//! // A batch's schedule: tasks of vertices that can run together (here one
//! // vertex function for every vertex), children before their parents.
//! let schedule = Schedule::build(&[&trees[0], &trees[1]], BatchingPolicy::Cavs, 1, |_, _| Ok(0))?;
//! assert_eq!(schedule.tasks.len(), 3); // the leaves, then two levels of parents
//! # Ok(())
//! # }
//! ```

pub mod binarize;
pub mod images;
pub mod input;
pub mod linearize;
pub mod ptb;
pub mod random;
#[cfg(test)]
mod reader_props;
pub mod safetensors_vectors;
pub mod schedule;
pub mod sequence;
pub mod structure;
pub mod synthetic;
pub mod tagged;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod text;
pub mod unroll;
pub mod vectors;
pub mod vocab;

pub use input::{GraphShape, InputGraph, Origin, NO_LABEL};
pub use linearize::{CsrGraph, LinearBatch, Linearizer, NO_CHILD};
pub use schedule::{BatchingPolicy, FunctionRows, Schedule, Task};
pub use structure::check_structure;
pub use unroll::UnrolledPlan;
pub use vocab::{Vocab, VocabMode};

use std::path::PathBuf;

/// Errors from building, reading or scheduling input graphs.
#[derive(Debug, thiserror::Error)]
pub enum GraphError {
    /// Malformed text, with the place it was found.
    #[error("{file}:{line}:{column}: {message}")]
    Parse {
        file: String,
        line: usize,
        column: usize,
        message: String,
    },
    /// A data file (or standard input) with nothing to read: empty, or
    /// only blank lines. `what` names what it should hold ("trees").
    #[error("{file}: no {what} to read: it is empty or holds only blank lines")]
    Empty { file: String, what: &'static str },
    /// A malformed binary file (no lines to name), and what is wrong.
    #[error("{file}: {message}")]
    Format { file: String, message: String },
    /// A structural problem (bad child id, mismatched lengths).
    #[error("invalid graph: {0}")]
    Structure(String),
    /// A vertex the model cannot run as it is (no function for its kind,
    /// more or fewer children than its function reads): `place` is the
    /// graph's `file:line` ([`InputGraph::describe`]).
    #[error("{place}: vertex {vertex} {message}")]
    Unfit {
        place: String,
        vertex: usize,
        message: String,
    },
    /// An empty batch or a batch that cannot be scheduled.
    #[error("cannot schedule batch: {0}")]
    Schedule(String),
    /// A file that could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}
