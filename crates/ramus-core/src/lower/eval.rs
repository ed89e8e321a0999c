//! The values of the reference evaluation
//! ([`CellProgram::eval_vertex`](super::CellProgram::eval_vertex)), and
//! [`map_rows`], how cell programs run their maps. A leaf: it names nothing
//! of the lowering.

use crate::error::{CoreError, Result};
use crate::graph::{DType, Space};
use crate::op::OpDef;

/// One vertex's inputs for
/// [`CellProgram::eval_vertex`](super::CellProgram::eval_vertex).
#[derive(Clone, Copy, Debug)]
pub struct VertexInputs<'a, T> {
    /// The state rows of the vertex's children, in order (the edges).
    pub children: &'a [&'a [T]],
    /// The vertex's token (for embeddings).
    pub token: Option<u32>,
    /// The head's input row (for a head program).
    pub head_input: Option<&'a [T]>,
    /// The vertex's token's row of the cell's token table (for a program
    /// with hoisted values).
    pub token_table: Option<&'a [T]>,
}

/// A value of one vertex: one row, or one row per child edge.
pub(super) enum Rows<T> {
    Vertex(Vec<T>),
    Edge(Vec<Vec<T>>),
}

impl<T> Rows<T> {
    /// The row for edge `e` (a vertex value is the same for every edge).
    pub(super) fn at(&self, e: usize) -> &[T] {
        match self {
            Rows::Vertex(v) => v,
            Rows::Edge(rows) => &rows[e],
        }
    }
}

pub(super) fn eval_error(message: impl Into<String>) -> CoreError {
    CoreError::Shape {
        context: "compiled-engine lowering".into(),
        op: "eval".into(),
        message: message.into(),
    }
}

/// One operand of [`map_rows`]: its data, and whether it is one row
/// broadcast to every row (a parameter, a constant) rather than a row each.
pub type MapOperand<'a, T> = (&'a [T], bool);

/// Runs elementwise op `op` through its CPU kernel over `rows` rows of
/// `width` columns into `out` (resized to `rows × width`): how cell
/// programs evaluate their maps (the reference here, the CPU compiled
/// engine level by level).
pub fn map_rows<T: crate::real::Real>(
    op: &dyn OpDef,
    operands: &[MapOperand<'_, T>],
    rows: usize,
    width: usize,
    out: &mut Vec<T>,
) -> Result<()> {
    let types: Vec<crate::graph::ValueType> = operands
        .iter()
        .map(|&(data, broadcast)| {
            if broadcast {
                crate::graph::ValueType {
                    space: Space::Static,
                    dtype: DType::Float,
                    shape: vec![data.len()],
                }
            } else {
                crate::graph::ValueType::rows(Space::Vertex, width)
            }
        })
        .collect();
    let args: Vec<crate::op::Arg<'_, T>> = types
        .iter()
        .zip(operands)
        .map(|(ty, &(data, broadcast))| crate::op::Arg {
            ty,
            rows: if broadcast { 1 } else { rows },
            data: crate::op::ArgData::Float(data),
        })
        .collect();
    out.clear();
    out.resize(rows * width, T::ZERO);
    let mut ctx = crate::op::KernelCtx {
        args: &args,
        out,
        out_rows: rows,
        vertex_rows: rows,
        edge_parent: &[],
        packed_b: None,
    };
    T::run_kernel(op, &mut ctx)
}
