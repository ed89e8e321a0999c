//! The reference evaluation of a lowered cell program
//! ([`CellProgram`]): [`eval_vertex`] runs one vertex, all units at once,
//! through the ops' own CPU kernels — the oracle the compiled engines are
//! checked against — and [`map_rows`] is how cell programs run their maps
//! (here and in the CPU compiled engine, level by level).

use ramus_core::graph::{DType, Graph, NodeId, ParamId, Space, ValueType};
use ramus_core::lower::{
    unsupported, CellProgram, ChildRef, ScalarExpr, ScalarNode, Scope, VecExpr, VecNode,
};
use ramus_core::ops::{unk_row, Op};
use ramus_core::real::Real;
use ramus_core::{CoreError, Result};

use crate::kernels::{self, Arg, ArgData, KernelCtx};

/// One vertex's inputs for [`eval_vertex`].
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
enum Rows<T> {
    Vertex(Vec<T>),
    Edge(Vec<Vec<T>>),
}

impl<T> Rows<T> {
    /// The row for edge `e` (a vertex value is the same for every edge).
    fn at(&self, e: usize) -> &[T] {
        match self {
            Rows::Vertex(v) => v,
            Rows::Edge(rows) => &rows[e],
        }
    }
}

fn eval_error(message: impl Into<String>) -> CoreError {
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
pub fn map_rows<T: Real>(
    op: &Op,
    operands: &[MapOperand<'_, T>],
    rows: usize,
    width: usize,
    out: &mut Vec<T>,
) -> Result<()> {
    let types: Vec<ValueType> = operands
        .iter()
        .map(|&(data, broadcast)| {
            if broadcast {
                ValueType {
                    space: Space::Static,
                    dtype: DType::Float,
                    shape: vec![data.len()],
                }
            } else {
                ValueType::rows(Space::Vertex, width)
            }
        })
        .collect();
    let args: Vec<Arg<'_, T>> = types
        .iter()
        .zip(operands)
        .map(|(ty, &(data, broadcast))| Arg {
            ty,
            rows: if broadcast { 1 } else { rows },
            data: ArgData::Float(data),
        })
        .collect();
    out.clear();
    out.resize(rows * width, T::ZERO);
    let mut ctx = KernelCtx {
        args: &args,
        out,
        out_rows: rows,
        vertex_rows: rows,
        edge_parent: &[],
        packed_b: None,
        norm_sum: None,
    };
    kernels::run(op, &mut ctx)
}

/// Evaluates `program` (lowered from graph `g`) for one vertex, all units
/// at once, through the ops' own CPU kernels: the oracle the compiled
/// engines are checked against. Returns each output's row
/// (`output_width(o)` wide). `params[p]` holds parameter `p`'s data
/// (row-major).
pub fn eval_vertex<T: Real>(
    program: &CellProgram,
    g: &Graph,
    params: &[&[T]],
    inputs: &VertexInputs<'_, T>,
) -> Result<Vec<Vec<T>>> {
    let edges = inputs.children.len();
    let ev = Vertex {
        g,
        params,
        inputs,
        units: program.units,
        edges,
    };
    let u = program.units;
    // stage by stage: a stage's vectors, its scalars, then its stores
    let mut vecs: Vec<Rows<T>> = (0..program.vectors.len())
        .map(|_| Rows::Vertex(Vec::new()))
        .collect();
    let mut scalars: Vec<Rows<T>> = (0..program.scalars.len())
        .map(|_| Rows::Vertex(Vec::new()))
        .collect();
    let mut scratch = vec![T::ZERO; program.scratch_width];
    for stage in 0..program.stages {
        for (vi, v) in program
            .vectors
            .iter()
            .enumerate()
            .filter(|(_, v)| v.stage == stage)
        {
            let value = match v.scope {
                Scope::Vertex => Rows::Vertex(ev.vector_row(v, 0, &vecs, &scratch)?),
                Scope::Edge => Rows::Edge(
                    (0..edges)
                        .map(|e| ev.vector_row(v, e, &vecs, &scratch))
                        .collect::<Result<_>>()?,
                ),
            };
            vecs[vi] = value;
        }
        for (si, s) in program
            .scalars
            .iter()
            .enumerate()
            .filter(|(_, s)| s.stage == stage)
        {
            let value = match s.scope {
                Scope::Vertex => Rows::Vertex(ev.scalar_row(s, 0, &vecs, &scalars)?),
                Scope::Edge => Rows::Edge(
                    (0..edges)
                        .map(|e| ev.scalar_row(s, e, &vecs, &scalars))
                        .collect::<Result<_>>()?,
                ),
            };
            scalars[si] = value;
        }
        for &(sc, col) in program.stores.get(stage).into_iter().flatten() {
            match &scalars[sc] {
                Rows::Vertex(v) => scratch[col..col + u].copy_from_slice(v),
                Rows::Edge(_) => return Err(eval_error("a stored value lives on the edges")),
            }
        }
    }
    let mut outs = Vec::with_capacity(program.outputs.len());
    for lanes in &program.outputs {
        let mut row = Vec::with_capacity(lanes.len() * u);
        for &s in lanes {
            match &scalars[s] {
                Rows::Vertex(v) => row.extend_from_slice(v),
                Rows::Edge(_) => return Err(eval_error("an output lives on the edges")),
            }
        }
        outs.push(row);
    }
    Ok(outs)
}

/// What [`eval_vertex`] evaluates against: the graph, the parameters and
/// the vertex's inputs.
struct Vertex<'a, 'v, T> {
    g: &'a Graph,
    params: &'a [&'a [T]],
    inputs: &'a VertexInputs<'v, T>,
    units: usize,
    /// The vertex's child edges.
    edges: usize,
}

impl<T: Real> Vertex<'_, '_, T> {
    /// Parameter `p`'s data.
    fn param(&self, p: ParamId) -> Result<&[T]> {
        self.params
            .get(p)
            .copied()
            .ok_or_else(|| eval_error(format!("parameter {p} missing")))
    }

    /// Vector `v`'s row for edge `e` (`e = 0` for a vertex vector), from
    /// the vectors computed so far and the scratch row.
    fn vector_row(&self, v: &VecNode, e: usize, vecs: &[Rows<T>], scratch: &[T]) -> Result<Vec<T>> {
        let (g, inputs, edges) = (self.g, self.inputs, self.edges);
        let param = |p: ParamId| self.param(p);
        let w = v.width;
        Ok(match &v.expr {
            VecExpr::ChildState(which) => {
                let child = match which {
                    ChildRef::Index(k) => inputs.children.get(*k).copied(),
                    ChildRef::Edge => inputs.children.get(e).copied(),
                };
                match child {
                    Some(c) if c.len() >= w => c[..w].to_vec(),
                    Some(c) => {
                        return Err(eval_error(format!(
                            "a child state of {} values, {w} read",
                            c.len()
                        )))
                    }
                    None => vec![T::ZERO; w],
                }
            }
            VecExpr::Embedding { table } => {
                let t = inputs
                    .token
                    .ok_or_else(|| eval_error("an embedding without a token"))?
                    as usize;
                param(*table)?
                    .get(t * w..(t + 1) * w)
                    .ok_or_else(|| eval_error(format!("token {t} beyond the table")))?
                    .to_vec()
            }
            VecExpr::EmbeddingUnk { table, rows } => {
                let t = inputs
                    .token
                    .ok_or_else(|| eval_error("an embedding without a token"))?;
                let r = unk_row(t, *rows);
                param(*table)?
                    .get(r * w..(r + 1) * w)
                    .ok_or_else(|| eval_error(format!("table {table} too short")))?
                    .to_vec()
            }
            VecExpr::HeadInput => inputs
                .head_input
                .and_then(|h| h.get(..w))
                .ok_or_else(|| eval_error("no head input row"))?
                .to_vec(),
            VecExpr::One => vec![T::ONE; w],
            VecExpr::Staged { slot } => scratch
                .get(*slot..*slot + w)
                .ok_or_else(|| eval_error("a scratch read beyond the scratch row"))?
                .to_vec(),
            VecExpr::TokenTable => inputs
                .token_table
                .and_then(|t| t.get(..w))
                .ok_or_else(|| eval_error("no token table row"))?
                .to_vec(),
            VecExpr::Param(p) => param(*p)?
                .get(..w)
                .ok_or_else(|| eval_error(format!("parameter {p} too short")))?
                .to_vec(),
            VecExpr::Slice { src, offset } => vecs[*src].at(e)[*offset..*offset + w].to_vec(),
            VecExpr::Concat { parts } => {
                let mut out = Vec::with_capacity(w);
                for &(p, pw) in parts {
                    out.extend_from_slice(&vecs[p].at(e)[..pw]);
                }
                out
            }
            VecExpr::Map { op, node, args } => {
                let rows: Vec<&[T]> = args.iter().map(|&a| vecs[a].at(e)).collect();
                map_kernel(g, op, *node, &rows, w)?
            }
            VecExpr::SumChildren(src) => {
                let mut acc = vec![T::ZERO; w];
                for k in 0..edges {
                    for (a, x) in acc.iter_mut().zip(vecs[*src].at(k)) {
                        *a += *x;
                    }
                }
                acc
            }
            VecExpr::Parent(src) => vecs[*src].at(0).to_vec(),
        })
    }

    /// Scalar `s`'s row (one value per unit) for edge `e` (`e = 0` for a
    /// vertex scalar), from the vectors and scalars computed so far.
    fn scalar_row(
        &self,
        s: &ScalarNode,
        e: usize,
        vecs: &[Rows<T>],
        scalars: &[Rows<T>],
    ) -> Result<Vec<T>> {
        let (g, u, edges) = (self.g, self.units, self.edges);
        let param = |p: ParamId| self.param(p);
        Ok(match &s.expr {
            ScalarExpr::Dot {
                weight,
                row,
                input,
                k,
            } => {
                let w = param(*weight)?;
                let x = vecs[*input].at(e);
                (0..u)
                    .map(|j| {
                        let wr = &w[(row + j) * k..(row + j + 1) * k];
                        wr.iter().zip(x).fold(T::ZERO, |acc, (a, b)| acc + *a * *b)
                    })
                    .collect()
            }
            ScalarExpr::RowDot {
                matrix,
                row,
                vector,
                k,
            } => {
                let (mat, x) = (vecs[*matrix].at(e), vecs[*vector].at(e));
                (0..u)
                    .map(|j| {
                        let r = mat
                            .get((row + j) * k..(row + j + 1) * k)
                            .ok_or_else(|| eval_error("a matrix row beyond its vector"))?;
                        Ok(r.iter().zip(x).fold(T::ZERO, |acc, (a, b)| acc + *a * *b))
                    })
                    .collect::<Result<_>>()?
            }
            ScalarExpr::ColumnDot {
                weight,
                base,
                step,
                input,
                offset,
                stride,
                k,
            } => {
                let (w, x) = (param(*weight)?, vecs[*input].at(e));
                let last = k.saturating_sub(1);
                if *k == 0 || base + last * step >= w.len() || last * stride + offset + u > x.len()
                {
                    return Err(eval_error("a column product beyond its operands"));
                }
                (0..u)
                    .map(|j| {
                        (0..*k).fold(T::ZERO, |acc, t| {
                            acc + w[base + t * step] * x[t * stride + offset + j]
                        })
                    })
                    .collect()
            }
            ScalarExpr::Read { src, col } => vecs[*src].at(e)[*col..*col + u].to_vec(),
            ScalarExpr::Param { param: p, col } => param(*p)?
                .get(*col..*col + u)
                .ok_or_else(|| eval_error(format!("parameter {p} too short")))?
                .to_vec(),
            ScalarExpr::Map { op, node, args } => {
                let rows: Vec<&[T]> = args.iter().map(|&a| scalars[a].at(e)).collect();
                map_kernel(g, op, *node, &rows, u)?
            }
            ScalarExpr::ChildSum(src) => {
                let mut acc = vec![T::ZERO; u];
                for k in 0..edges {
                    for (a, x) in acc.iter_mut().zip(scalars[*src].at(k)) {
                        *a += *x;
                    }
                }
                acc
            }
        })
    }
}

/// Elementwise op `op` (of node `node`) on one row of `width` columns.
fn map_kernel<T: Real>(
    g: &Graph,
    op: &Op,
    node: NodeId,
    rows: &[&[T]],
    width: usize,
) -> Result<Vec<T>> {
    let operands: Vec<MapOperand<'_, T>> = rows.iter().map(|r| (&r[..width], false)).collect();
    let mut out = Vec::with_capacity(width);
    map_rows(op, &operands, 1, width, &mut out).map_err(|e| unsupported(g, node, e.to_string()))?;
    Ok(out)
}
