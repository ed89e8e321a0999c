//! Kernel fusion: the NNVM "Fusion" pass (Cavs §3.5); its "CodeGen" is
//! `ramus_codegen::fused`.
//!
//! [`fuse`] takes one phase's op list (an [`ExecPlan`](crate::plan::ExecPlan)
//! list, in topological order) and groups connected elementwise ops — ops
//! with an [`OpDef::elementwise_template`](crate::op::OpDef::elementwise_template)
//! — with union-find into [`FusedGroup`]s, each of which becomes a single
//! kernel. Two connected elementwise ops join when both are in the list,
//! agree in space and row width, and the merge keeps the graph of steps
//! acyclic: a path producer → other step → consumer would make the fused
//! kernel wait for itself. Groups that are not connected merge as
//! *siblings*: two groups of listed elementwise ops that agree in space and
//! width and read a common value (any node read by members of both) become
//! one kernel when neither can reach the other through a third unit
//! (checked in both directions: no producer/consumer edge orients the
//! check). This takes, say, the two products `x · p` and `x · q` of one
//! expanded row `x` into one kernel that reads `x` once. The
//! producer/consumer and sibling passes repeat until neither merges
//! anything (a merge can absorb the third unit that blocked another). The
//! result is a [`FusionPlan`]: steps (single ops or fused groups) in an
//! order that respects every dependency.
//!
//! A fused group reads its *inputs* (values computed outside it, each read
//! per element or, for a static bias of a row group, broadcast over rows)
//! and materializes only its *outputs* (members read outside the group, by
//! another phase, by the backward graph or as graph outputs). Everything
//! else stays in registers.
//!
//! Four data-movement ops need no kernel of their own:
//! * a `slice` whose every user reads it in place — a fused group (as an
//!   [`InputKind::Window`] of the slice's source) or a `matmul` operand
//!   that cuBLAS can take with a leading dimension — becomes a
//!   [`SliceView`];
//! * a `concat` whose every input is a fused-group member is written in
//!   place: each group stores those members straight into the concat's
//!   buffer at their column offset ([`ConcatWrite`]), and a member the
//!   concat alone read needs no buffer of its own;
//! * a `sum_children` whose every user is a fused elementwise op on vertex
//!   rows of its width is an *inline read* ([`FusionPlan::inline_reads`]):
//!   each reading group sums the child edge rows itself through the CSR
//!   edge offsets ([`InputKind::ChildSum`]);
//! * likewise an `expand_children` whose every user is a fused elementwise
//!   op on edge rows of its width: each reading group reads the parent
//!   vertex row of each edge through the parent indices
//!   ([`InputKind::ParentRow`]).
//!
//! Together with [`crate::simplify::pads_to_concat`] (which turns the
//! pad-and-add gradients of slices back into concats) this removes the
//! copy kernels around the fused cells of an LSTM-like function, and the
//! child-sum and expand kernels around the cells of a child-sum Tree-LSTM
//! and its derivative.
//!
//! For each group this module renders the members as C expressions from
//! the ops' registered templates ([`FusedGroup::members_code`], from which
//! `ramus_codegen::fused` generates one CUDA C++ kernel per group); the
//! CPU engine evaluates a group through the ops' own kernels
//! (`ramus_cpu::fused::eval_group`): the oracle the generated code is
//! tested against.

mod code;
mod listing;
mod pass;
mod types;
mod units;

pub use code::{instantiate, MemberCode};
pub use pass::{forward_reads, fuse, reads_in_place};
pub use types::{
    group_error, node_error, ConcatWrite, FusedGroup, FusedInput, FusionPlan, InputKind, SliceView,
    Step,
};
