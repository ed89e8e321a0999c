//! The fusion plan's types and its errors.

use crate::error::CoreError;
use crate::graph::{Graph, NodeId, Space};

/// How a fused kernel reads one of its inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum InputKind {
    /// One element per output element (`in[i]`): a row value of the group's
    /// space and width, or, in a static group, a tensor of the group's shape.
    PerElement,
    /// A static row repeated for every row of a row group (`in[i % width]`):
    /// a bias.
    Broadcast,
    /// A column window of a wider row value, read in place: the input node
    /// is a `slice` that has no step of its own (a [`SliceView`]), and the
    /// kernel reads its `source` directly. Element `i` of the window is
    /// `source[(i / width) * stride + offset + i % width]` (`width` = the
    /// group's width = the slice's length, `stride` = the source's row width,
    /// `offset` = the slice's first column).
    Window {
        source: NodeId,
        offset: usize,
        stride: usize,
    },
    /// The sum over a vertex's child edges of an edge-row value (an inlined
    /// `sum_children`): element `i` (row `r = i / width`, column
    /// `j = i % width`) is `Σ_{e = rows[r] - base .. rows[r + 1] - base}
    /// source[e * width + j]`, summed in edge order from zero. The input's
    /// `node` is the `sum_children` node (an inline read, without a step),
    /// `source` its operand; `rows` are the CSR edge offsets of the group's
    /// vertex rows.
    ChildSum { source: NodeId },
    /// An edge row's parent vertex row (an inlined `expand_children`):
    /// element `i` (edge `e = i / width`) is
    /// `source[(rows[e] - base) * width + i % width]`. The input's `node` is
    /// the `expand_children` node (an inline read, without a step),
    /// `source` its operand; `rows` holds the parent vertex of each of the
    /// group's edge rows.
    ParentRow { source: NodeId },
}

impl InputKind {
    /// Short name of the kind, for errors.
    pub fn short(self) -> &'static str {
        match self {
            InputKind::PerElement => "elem",
            InputKind::Broadcast => "bcast",
            InputKind::Window { .. } => "win",
            InputKind::ChildSum { .. } => "csum",
            InputKind::ParentRow { .. } => "parent",
        }
    }

    /// True for the kinds read through the row topology
    /// ([`ChildSum`](InputKind::ChildSum), [`ParentRow`](InputKind::ParentRow)):
    /// their kernels take an index array and a base besides the data (see
    /// `ramus_codegen::fused` and `ramus_cpu::fused::eval_group`).
    pub fn is_csr(self) -> bool {
        matches!(
            self,
            InputKind::ChildSum { .. } | InputKind::ParentRow { .. }
        )
    }

    /// The node whose buffer the kernel reads for an input of this kind
    /// whose own node is `node`: the source of a window or an inline read,
    /// otherwise `node` itself.
    pub fn buffer(self, node: NodeId) -> NodeId {
        match self {
            InputKind::PerElement | InputKind::Broadcast => node,
            InputKind::Window { source, .. }
            | InputKind::ChildSum { source }
            | InputKind::ParentRow { source } => source,
        }
    }
}

/// A value a fused group reads from outside.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FusedInput {
    /// The value the members read (for a window: the viewed slice; for a
    /// child sum or parent row: the inlined `sum_children` or
    /// `expand_children` node).
    pub node: NodeId,
    pub kind: InputKind,
}

impl FusedInput {
    /// The node whose buffer the kernel reads (see [`InputKind::buffer`]).
    pub fn buffer(&self) -> NodeId {
        self.kind.buffer(self.node)
    }
}

/// A member of a fused group that the kernel also stores into the buffer of
/// a `concat` written in place (see [`FusionPlan::in_place_concats`]): row
/// `r` of the member goes to columns `offset..offset + width` of row `r` of
/// the concat, i.e. element `i` to `concat[(i / width) * stride + offset + i % width]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConcatWrite {
    pub member: NodeId,
    pub concat: NodeId,
    /// First column of the member inside the concat's rows.
    pub offset: usize,
    /// Row width of the concat.
    pub stride: usize,
}

/// Connected elementwise ops run as one kernel. See the module docs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FusedGroup {
    /// Member op nodes in topological order.
    pub nodes: Vec<NodeId>,
    /// Values read from outside the group, in first-use order, each once.
    pub inputs: Vec<FusedInput>,
    /// Members whose values are materialized in buffers of their own, in
    /// member order.
    pub outputs: Vec<NodeId>,
    /// Members also stored into concats written in place, in member order
    /// (for one member: concats in node order, then column order).
    pub concat_writes: Vec<ConcatWrite>,
    /// Space of every member (the rows the kernel runs over).
    pub space: Space,
    /// Elements per row of every member (all elements for a static group).
    pub width: usize,
}

/// A `slice` that has no step: its users read a window of its source in
/// place (fused groups through [`InputKind::Window`], matmuls through the
/// leading dimension, `sum_children` with a row stride). Row `r` of the slice is
/// `source[r * stride + offset .. r * stride + offset + len]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SliceView {
    pub slice: NodeId,
    pub source: NodeId,
    /// First column (the slice's `start`).
    pub offset: usize,
    /// Row width of the source.
    pub stride: usize,
    /// Columns in the window (the slice's `len`).
    pub len: usize,
}

/// One step of a [`FusionPlan`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// A non-elementwise op node, run by its own kernel.
    Op(NodeId),
    /// Elementwise ops run as one kernel (possibly a single op).
    Fused(FusedGroup),
}

/// One phase's op nodes as kernels to launch, in dependency order.
///
/// Every op node of the phase is in exactly one step, or is a slice in
/// [`views`](FusionPlan::views), a concat in
/// [`in_place_concats`](FusionPlan::in_place_concats), or a `sum_children`
/// / `expand_children` in [`inline_reads`](FusionPlan::inline_reads): those
/// three have no step. A step that reads a viewed slice or an inline read
/// comes after the step computing its source; a step that reads an
/// in-place concat comes after every group writing into it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FusionPlan {
    pub steps: Vec<Step>,
    /// Slices read in place, in list order.
    pub views: Vec<SliceView>,
    /// Concats without a step: every input is a fused-group member that its
    /// group stores into the concat's buffer ([`FusedGroup::concat_writes`]).
    /// The concat still has its buffer (rows × its width); in list order.
    pub in_place_concats: Vec<NodeId>,
    /// `sum_children` and `expand_children` nodes without a step or a
    /// buffer: every reader is a fused group that reads the operand through
    /// the row topology ([`InputKind::ChildSum`], [`InputKind::ParentRow`]);
    /// in list order.
    pub inline_reads: Vec<NodeId>,
}

// ---------------------------------------------------------------- errors

/// An error at node `node` of `graph` in fusion (also the CPU evaluator's).
pub fn node_error(graph: &Graph, node: NodeId, message: impl Into<String>) -> CoreError {
    let op = graph
        .nodes
        .get(node)
        .map(|n| n.describe(&[]))
        .unwrap_or_else(|| "?".into());
    CoreError::Shape {
        context: "fusion".into(),
        op,
        message: format!("node %{node}: {}", message.into()),
    }
}

/// An error of the whole group `group` (also the CPU evaluator's).
pub fn group_error(group: &FusedGroup, message: impl Into<String>) -> CoreError {
    CoreError::Kernel {
        op: group.describe(),
        message: message.into(),
    }
}
