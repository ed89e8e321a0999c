//! [`map_rows`], how cell programs run their maps (the reference
//! evaluation `ramus_cpu::cell_eval::eval_vertex`, the CPU compiled engine,
//! the refactoring's zero check). A leaf: it names nothing of the lowering.

use crate::error::Result;
use crate::graph::{DType, Space};
use crate::op::OpDef;

/// One operand of [`map_rows`]: its data, and whether it is one row
/// broadcast to every row (a parameter, a constant) rather than a row each.
pub type MapOperand<'a, T> = (&'a [T], bool);

/// Runs elementwise op `op` through its CPU kernel over `rows` rows of
/// `width` columns into `out` (resized to `rows × width`): how cell
/// programs evaluate their maps (the reference evaluation vertex by vertex,
/// the CPU compiled engine level by level).
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
