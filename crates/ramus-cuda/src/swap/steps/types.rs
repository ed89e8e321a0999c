//! The vocabulary of a swap iteration: which graph, what kind of iteration,
//! the rows an op runs over, the ops and the finished [`SwapProgram`]
//! (shared by the static and the dynamic builders and the executor).

use ramus_core::graph::{DType, Graph, NodeId, Space};
use ramus_core::Model;
use ramus_swap::{TensorId, Trace};

use crate::offset_allocator::aligned_size;
use crate::program::{GraphProgram, Program};

/// A graph of the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum GraphRef {
    /// Vertex function `f`'s forward graph.
    Forward(usize),
    /// Vertex function `f`'s backward graph.
    Backward(usize),
    /// The head.
    Head,
    /// The head's backward graph.
    HeadBackward,
}

impl GraphRef {
    /// Position in per-graph arrays: `2f`, `2f + 1`, then the head's two.
    pub(crate) fn index(self, functions: usize) -> usize {
        match self {
            GraphRef::Forward(f) => 2 * f,
            GraphRef::Backward(f) => 2 * f + 1,
            GraphRef::Head => 2 * functions,
            GraphRef::HeadBackward => 2 * functions + 1,
        }
    }

    /// The graph itself.
    pub(crate) fn graph(self, model: &Model) -> &Graph {
        match self {
            GraphRef::Forward(f) => &model.functions[f].forward,
            GraphRef::Backward(f) => &model.functions[f].backward,
            GraphRef::Head => &model.head.forward,
            GraphRef::HeadBackward => &model.head.backward,
        }
    }

    /// Its program for an iteration of `kind` (training keeps the values
    /// the backward graphs read; evaluation and inference keep fewer).
    pub(crate) fn program(self, program: &Program, kind: Kind) -> &GraphProgram {
        match (self, kind) {
            (GraphRef::Forward(f), Kind::Train { .. }) => &program.functions[f].0,
            (GraphRef::Forward(f), _) => &program.infer_functions[f],
            (GraphRef::Backward(f), _) => &program.functions[f].1,
            (GraphRef::Head, Kind::Train { .. }) => &program.head_forward,
            (GraphRef::Head, _) => &program.head_forward_infer,
            (GraphRef::HeadBackward, _) => &program.head_backward,
        }
    }

    /// The forward graph whose values a backward graph reads.
    pub(crate) fn forward(self) -> Option<GraphRef> {
        match self {
            GraphRef::Backward(f) => Some(GraphRef::Forward(f)),
            GraphRef::HeadBackward => Some(GraphRef::Head),
            _ => None,
        }
    }

    /// The vertex function whose rows (and topology) the graph runs over.
    pub(crate) fn function(self) -> Option<usize> {
        match self {
            GraphRef::Forward(f) | GraphRef::Backward(f) => Some(f),
            _ => None,
        }
    }

    pub(super) fn label(self, model: &Model) -> String {
        match self {
            GraphRef::Forward(f) => format!("F {}", model.functions[f].name),
            GraphRef::Backward(f) => format!("∂F {}", model.functions[f].name),
            GraphRef::Head => "head".into(),
            GraphRef::HeadBackward => "head ∂".into(),
        }
    }
}

/// What an iteration computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Kind {
    /// Forward, backward and the optimizer step, with this many
    /// parameter-sized optimizer state tensors per parameter.
    Train { states: usize },
    /// The forward pass with the loss (and scores).
    Evaluate,
    /// The forward pass up to the scores.
    Infer,
}

impl Kind {
    pub(super) fn training(self) -> bool {
        matches!(self, Kind::Train { .. })
    }
}

/// The rows an op runs over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Rows {
    /// Every row of the graph (static-graph models, the head).
    All,
    /// The rows of segment `.0` of [`SwapProgram::segments`] (dynamic
    /// models: eager and lazy steps, uploads, accumulations).
    Segment(usize),
    /// The rows of piece `.0` of [`SwapProgram::pieces`] (dynamic models:
    /// per-task steps on a batching task, or on part of a large one).
    Piece(usize),
}

/// A batching task's rows, or a run of the rows of a large one (its rows
/// are independent of each other): what a dynamic model's per-task steps
/// run over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Piece {
    /// The schedule's task.
    pub task: usize,
    pub r0: usize,
    pub r1: usize,
    pub e0: usize,
    pub e1: usize,
}

impl Piece {
    pub(crate) fn range(&self) -> ramus_exec::Range {
        ramus_exec::Range {
            r0: self.r0,
            r1: self.r1,
            e0: self.e0,
            e1: self.e1,
        }
    }
}

/// Consecutive pieces of batching tasks of one vertex function whose rows
/// (and edges) are contiguous: the unit in which a dynamic model's node
/// buffers become tensors (see the `dynamic` module).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Segment {
    pub function: usize,
    /// Its pieces `pieces.start..pieces.end` of [`SwapProgram::pieces`].
    pub pieces: std::ops::Range<usize>,
    /// Function rows `r0..r1` and edges `e0..e1`.
    pub r0: usize,
    pub r1: usize,
    pub e0: usize,
    pub e1: usize,
}

impl Segment {
    pub(crate) fn range(&self) -> ramus_exec::Range {
        ramus_exec::Range {
            r0: self.r0,
            r1: self.r1,
            e0: self.e0,
            e1: self.e1,
        }
    }
}

/// A run of index words in [`SwapProgram::indices`]: `offset..offset + len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Words {
    pub offset: usize,
    pub len: usize,
}

/// One row move between two tensors' own memory (rows counted from each
/// tensor's first row; `NONE` rows as in [`crate::launch::RowMove`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct MoveSpec {
    pub dst: TensorId,
    /// `None`: zeros (every source row is `NONE`).
    pub src: Option<TensorId>,
    pub dst_rows: Option<Words>,
    pub src_rows: Option<Words>,
    pub rows: usize,
    pub width: usize,
    pub accumulate: bool,
}

/// One op of the iteration.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum SwapOp {
    /// Copy function `f`'s pulled inputs (the images) of `rows` from the host.
    UploadPull { f: usize, node: NodeId, rows: Rows },
    /// Copy `rows` of dropout mask `mask` (drawn at the start of the step)
    /// from the host.
    UploadMask { mask: usize, rows: Rows },
    /// A planned step of a graph's phase over `rows`.
    Step {
        graph: GraphRef,
        phase: usize,
        index: usize,
        rows: Rows,
    },
    /// Gather every function's pushed rows into the head input.
    HeadInput,
    /// Copy the loss to the host (asynchronously; read at the end).
    ReadLoss,
    /// Copy the scores to the host (asynchronously; read at the end).
    ReadLogits,
    /// Zero every parameter gradient.
    ZeroGrads,
    /// Fill an output-gradient input of a backward graph (1 for the loss),
    /// or a dropout mask with ones when not training.
    Seed {
        graph: GraphRef,
        node: NodeId,
        value: f32,
    },
    /// Add the head input's gradient into every function's pushed gradient.
    PushGrads,
    /// Add output `output` (a parameter gradient, or an embedding table's
    /// row gradient) of a backward graph over `rows` into the parameter's
    /// gradient.
    AccumulateGrad {
        graph: GraphRef,
        output: usize,
        rows: Rows,
    },
    /// Row moves [`SwapProgram::move_sets`]`[set]` in one launch (a dynamic
    /// model's gathers, child gradients, head input and pushed gradients).
    Moves { set: usize },
    /// The fused optimizer step.
    Optimizer,
}

/// Where a (non-persistent) tensor lives: a node of a graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Home {
    pub graph: GraphRef,
    pub node: NodeId,
    pub dtype: DType,
    /// Elements.
    pub len: usize,
    /// Elements of the node's buffer before the tensor's first one: a
    /// dynamic model's segment tensor holds rows `r0..` of its node, and the
    /// engine addresses them by their row in the function (0 when the
    /// tensor is the whole buffer).
    pub at: usize,
}

/// The iteration: ops, tensors and the trace the planner reads.
#[derive(Clone, Debug)]
pub(crate) struct SwapProgram {
    pub ops: Vec<SwapOp>,
    /// Per trace tensor: its node, or `None` for persistent tensors.
    pub homes: Vec<Option<Home>>,
    /// Nodes whose buffer is empty (no tensor): they get an empty view.
    pub empty: Vec<(GraphRef, NodeId, DType)>,
    /// Dropout masks in draw order: graph, node, elements, rate (in 1e-4).
    pub masks: Vec<(GraphRef, NodeId, usize, u16)>,
    /// Floats of scratch memory the largest op needs.
    pub workspace_floats: usize,
    /// Per op, its estimated work: floating-point operations and bytes
    /// moved (the op registry's cost model; host copies count their bytes).
    pub costs: Vec<(f64, f64)>,
    pub kind: Kind,
    pub trace: Trace,
    /// Dynamic models: the segments their function tensors are cut into
    /// (empty for static-graph models: one tensor per node).
    pub segments: Vec<Segment>,
    /// Dynamic models: the pieces of tasks the segments are made of.
    pub pieces: Vec<Piece>,
    /// Row moves of the [`SwapOp::Moves`] ops.
    pub move_sets: Vec<Vec<MoveSpec>>,
    /// Index words of the moves, uploaded once per step.
    pub indices: Vec<u32>,
}

impl SwapProgram {
    /// A hash of what a plan depends on: tensor sizes and kinds, each op's
    /// reads and writes, the segments and the moves' shapes (not the index
    /// words, which change with the batch's topology while the plan holds).
    pub(crate) fn fingerprint(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        for t in self.trace.tensors() {
            t.bytes.hash(&mut h);
            t.kind.hash(&mut h);
        }
        for op in self.trace.ops() {
            op.reads.hash(&mut h);
            op.writes.hash(&mut h);
            op.phase.hash(&mut h);
        }
        self.segments.hash(&mut h);
        self.pieces.hash(&mut h);
        self.move_sets.hash(&mut h);
        h.finish()
    }

    /// Whether `other` runs the same ops on the same tensors (a plan made
    /// for one holds for the other), checked in full after fingerprints
    /// matched.
    pub(crate) fn same_structure(&self, other: &SwapProgram) -> bool {
        let (a, b) = (&self.trace, &other.trace);
        a.tensors() == b.tensors()
            && a.num_ops() == b.num_ops()
            && a.ops().iter().zip(b.ops()).all(|(x, y)| {
                x.reads == y.reads && x.writes == y.writes && x.phase == y.phase && x.name == y.name
            })
            && self.ops == other.ops
            && self.segments == other.segments
            && self.pieces == other.pieces
            && self.move_sets == other.move_sets
            && self.homes == other.homes
    }
}

/// Rows of each function and of the head for a batch.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Shape {
    pub rows: Vec<usize>,
    pub edges: Vec<usize>,
    pub head_rows: usize,
    /// Head rows served by each function.
    pub head_rows_of: Vec<usize>,
}

impl Shape {
    pub(super) fn count(&self, graph: GraphRef, space: Space) -> usize {
        match (graph.function(), space) {
            (_, Space::Static) => 1,
            (Some(f), Space::Vertex) => self.rows[f],
            (Some(f), Space::Edge) => self.edges[f],
            (None, _) => self.head_rows,
        }
    }
}

/// The segment key of tensors that are a node's whole buffer.
pub(super) const WHOLE: usize = usize::MAX;

/// Bytes of a buffer of `len` 4-byte elements as the pool allocates it.
pub(super) fn pool_bytes(len: usize) -> u64 {
    aligned_size(len as u64 * 4).unwrap_or(u64::MAX)
}
