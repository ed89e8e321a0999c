//! What the CPU batched engine's passes share with the modules that run
//! them: each graph's node values ([`Arena`]), the packed weights
//! ([`Packs`]) and the rows a node list runs over ([`Span`]).

use std::collections::HashMap;

use crate::kernels::PackedB;
use ramus_core::graph::{DType, Graph, NodeKind, ParamId, Source, Space};
use ramus_core::Real;

use ramus_exec::Range;

/// Values of one graph's nodes for a batch: floats or indices per node.
#[derive(Default)]
pub(super) struct Arena<T> {
    pub(super) vals: Vec<Vec<T>>,
    pub(super) idx: Vec<Vec<u32>>,
    /// Set for evaluation and inference passes: nodes whose op has an
    /// inference form ([`ramus_core::ops::Op::inference_op`]) run that instead.
    pub(super) inference: bool,
    /// Set in the training passes of a data-parallel rank with
    /// synchronized batch normalisation.
    pub(super) norm_sync: Option<super::norm_sync::NormShare<T>>,
}

impl<T: Real> Arena<T> {
    pub(super) fn prepare(&mut self, graph: &Graph, rows: usize, edges: usize) {
        self.vals.resize_with(graph.nodes.len(), Vec::new);
        self.idx.resize_with(graph.nodes.len(), Vec::new);
        for (n, node) in graph.nodes.iter().enumerate() {
            let count = match node.ty.space {
                Space::Vertex => rows,
                Space::Edge => edges,
                Space::Static => 1,
            };
            let len = count * node.ty.width();
            if matches!(node.kind, NodeKind::Param(_))
                || matches!(node.kind, NodeKind::Input(Source::Forward(_)))
            {
                self.vals[n].clear();
                self.idx[n].clear();
                continue;
            }
            match node.ty.dtype {
                DType::Float => self.vals[n].resize(len, T::ZERO),
                DType::Index => self.idx[n].resize(len, 0),
            }
        }
    }
}

/// Weights packed for small-row products, by (parameter, transposed), valid
/// for one pass (parameters do not change within a pass).
pub(super) type Packs<T> = HashMap<(ParamId, bool), PackedB<T>>;

/// The rows and edges a node list runs over, with each edge's parent row
/// (relative to the range).
#[derive(Clone, Copy)]
pub(super) struct Span<'a> {
    pub(super) range: Range,
    pub(super) edge_parent: &'a [u32],
}

impl Span<'_> {
    /// `range` with no edges.
    pub(super) fn rows_only(range: Range) -> Self {
        Span {
            range,
            edge_parent: &[],
        }
    }
}
