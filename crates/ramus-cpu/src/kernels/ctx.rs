//! What a CPU kernel sees ([`KernelCtx`]: arguments, output, row topology)
//! and the [`Kernel`] trait every op type implements in the kernel modules
//! beside this one. A leaf: the kernel modules and the dispatch in
//! [`super::run`] use it.

use ramus_core::graph::ValueType;
use ramus_core::real::Real;
use ramus_core::{CoreError, Result};

use super::packed::PackedB;

/// Data of one kernel argument.
#[derive(Clone, Copy, Debug)]
pub enum ArgData<'a, T> {
    Float(&'a [T]),
    Index(&'a [u32]),
}

/// One kernel argument: its declared type, its row count at run time
/// (1 for static values) and its data.
#[derive(Clone, Copy, Debug)]
pub struct Arg<'a, T> {
    pub ty: &'a ValueType,
    pub rows: usize,
    pub data: ArgData<'a, T>,
}

impl<'a, T> Arg<'a, T> {
    /// The float data (kernels are only handed index data where they declared it).
    pub fn floats(&self, op: &str) -> Result<&'a [T]> {
        match self.data {
            ArgData::Float(d) => Ok(d),
            ArgData::Index(_) => Err(CoreError::kernel(
                op,
                "expected a float argument, got indices",
            )),
        }
    }
    /// The index data.
    pub fn indices(&self, op: &str) -> Result<&'a [u32]> {
        match self.data {
            ArgData::Index(d) => Ok(d),
            ArgData::Float(_) => Err(CoreError::kernel(
                op,
                "expected an index argument, got floats",
            )),
        }
    }
}

/// Everything a CPU kernel sees: arguments, the output buffer (overwritten,
/// sized `out_rows * width`), and the edge topology of the rows being run.
pub struct KernelCtx<'a, T> {
    pub args: &'a [Arg<'a, T>],
    pub out: &'a mut [T],
    pub out_rows: usize,
    /// Number of vertex rows in this run.
    pub vertex_rows: usize,
    /// For each edge row of this run, the vertex row (0-based in this run) it belongs to.
    pub edge_parent: &'a [u32],
    /// The static second operand pre-packed by the engine, for ops that ask
    /// for it through [`OpDef::packed_operand`](ramus_core::OpDef::packed_operand).
    pub packed_b: Option<&'a PackedB<T>>,
    /// Set in the training passes of a data-parallel run with synchronized
    /// batch normalisation: batch statistics are over every rank's rows.
    pub norm_sum: Option<&'a mut dyn NormSum>,
}

/// Sums per-channel statistics over the ranks of a data-parallel training
/// pass (synchronized batch normalisation). Every rank's kernels call it in
/// the same order with the same lengths.
pub trait NormSum {
    /// Replaces `values` with their sums over the ranks.
    fn sum(&mut self, values: &mut [f64]) -> Result<()>;
}

/// A CPU kernel written once for every [`Real`] type; one impl per op
/// type, reached through the exhaustive match in [`super::run`].
pub(crate) trait Kernel {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()>;
}
