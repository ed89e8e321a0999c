//! The cell program's types, the dependency queries over its expressions, and the lowering error.

use crate::error::CoreError;
use crate::graph::{Graph, NodeId, ParamId};
use crate::ops::Op;

/// Index of a [`VecNode`] in [`CellProgram::vectors`].
pub type VecId = usize;
/// Index of a [`ScalarNode`] in [`CellProgram::scalars`].
pub type ScalarId = usize;

/// Where a value lives: once per vertex, or once per child edge (inside a
/// loop over the vertex's children).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scope {
    Vertex,
    Edge,
}

/// Which child's state a vector reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ChildRef {
    /// Child `k` (`gather(k)`); zeros when the vertex has no child `k`.
    Index(usize),
    /// The child of the current edge (`gather_all()`, edge scope).
    Edge,
}

/// A vector value, defined column by column: column `t` of the value is
/// computed from column `t` (or a shifted column) of its operands.
#[derive(Clone, Debug)]
pub enum VecExpr {
    /// Column `t` of a child's state row.
    ChildState(ChildRef),
    /// Column `t` of the embedding row (`table` is a `[V, width]`
    /// parameter) of the vertex's token.
    Embedding { table: ParamId },
    /// Column `t` of row `unk_row(token, rows)` of `table` (a `[rows,
    /// width]` parameter): tokens beyond the table read row 0
    /// ([`EmbeddingUnk`]).
    EmbeddingUnk { table: ParamId, rows: usize },
    /// Column `t` of the value pushed to the head (the head's input).
    HeadInput,
    /// The constant 1 (a dropout mask at inference).
    One,
    /// Element `t` of a parameter (a static row, broadcast over vertices).
    Param(ParamId),
    /// Column `t + offset` of `src`.
    Slice { src: VecId, offset: usize },
    /// The parts side by side: `(part, width)` in column order.
    Concat { parts: Vec<(VecId, usize)> },
    /// An elementwise op (of graph node `node`) applied column by column.
    Map {
        op: Op,
        node: NodeId,
        args: Vec<VecId>,
    },
    /// The sum over the vertex's child edges of edge vector `src` (vertex scope).
    SumChildren(VecId),
    /// The vertex's own vector `src` read for each of its child edges (edge scope).
    Parent(VecId),
    /// Column `slot + t` of the vertex's scratch row: unit values stored by
    /// an earlier stage (vertex scope).
    Staged { slot: usize },
    /// Column `t` of the vertex's token's row of the cell's token table:
    /// values that depend on the token alone, computed once per token at
    /// load ([`CellProgram::hoist_token_values`]).
    TokenTable,
}

/// A vector with its width and scope.
#[derive(Clone, Debug)]
pub struct VecNode {
    pub expr: VecExpr,
    pub width: usize,
    pub scope: Scope,
    /// The stage from which it can be read (see [`CellProgram::stages`]).
    pub stage: usize,
}

/// A unit's scalar (for unit `j`).
#[derive(Clone, Debug)]
pub enum ScalarExpr {
    /// `Σ_t weight[row + j, t] · input[t]` over the `k` columns of vector
    /// `input` (`weight` is a `[rows, k]` parameter).
    Dot {
        weight: ParamId,
        row: usize,
        input: VecId,
        k: usize,
    },
    /// `Σ_t matrix[(row + j)·k + t] · vector[t]` over `t < k`: row
    /// `row + j` of a per-vertex matrix (`matrix`, row-major with `k`
    /// columns) times a per-vertex vector.
    RowDot {
        matrix: VecId,
        row: usize,
        vector: VecId,
        k: usize,
    },
    /// `Σ_t weight[base + t·step] · input[t·stride + offset + j]` over
    /// `t < k`: a row of a static matrix (the same elements for every unit)
    /// times column `offset + j` of a per-vertex matrix (`input`, row-major
    /// with `stride` columns).
    ColumnDot {
        weight: ParamId,
        base: usize,
        step: usize,
        input: VecId,
        offset: usize,
        stride: usize,
        k: usize,
    },
    /// Column `col + j` of vector `src`.
    Read { src: VecId, col: usize },
    /// Element `col + j` of a static parameter row (a bias).
    Param { param: ParamId, col: usize },
    /// An elementwise op (of graph node `node`) on scalars.
    Map {
        op: Op,
        node: NodeId,
        args: Vec<ScalarId>,
    },
    /// The sum over the vertex's child edges of edge scalar `src`.
    ChildSum(ScalarId),
}

/// A scalar with its scope. Operands always have smaller ids; an edge
/// scalar may read vertex scalars (the vertex's own values), a vertex
/// scalar reads edge scalars only through [`ScalarExpr::ChildSum`].
#[derive(Clone, Debug)]
pub struct ScalarNode {
    pub expr: ScalarExpr,
    pub scope: Scope,
    /// The stage it is computed in.
    pub stage: usize,
}

/// A lowered graph; see the module docs.
#[derive(Clone, Debug)]
pub struct CellProgram {
    /// `U`: unit `j < U` computes columns `m·U + j` of every unit value.
    pub units: usize,
    pub vectors: Vec<VecNode>,
    pub scalars: Vec<ScalarNode>,
    /// Per requested output node: its lanes (output column `m·U + j` is
    /// scalar `outputs[o][m]` of unit `j`).
    pub outputs: Vec<Vec<ScalarId>>,
    /// Stages of a multi-stage cell (1 otherwise): a product whose input
    /// is itself computed per unit (a TreeGRU's `U (Σ r_k ⊙ h_k)`) needs
    /// every unit's columns of that input, so the units store them in a
    /// per-vertex scratch row in one stage ([`CellProgram::stores`]) and
    /// read them back as a vector ([`VecExpr::Staged`]) in the next.
    pub stages: usize,
    /// Per stage: `(scalar, column)`: unit `j` stores the scalar at scratch
    /// column `column + j`.
    pub stores: Vec<Vec<(ScalarId, usize)>>,
    /// Columns of the scratch row.
    pub scratch_width: usize,
}

impl CellProgram {
    /// Width of output `o` (`lanes · units`).
    pub fn output_width(&self, o: usize) -> usize {
        self.outputs.get(o).map_or(0, |l| l.len() * self.units)
    }

    /// The `(weight, row)` pairs of every dot product: the weight rows a
    /// unit reads (rows `row + j`), in scalar order, each once.
    pub fn weight_rows(&self) -> Vec<(ParamId, usize)> {
        let mut rows = Vec::new();
        for s in &self.scalars {
            if let ScalarExpr::Dot { weight, row, .. } = s.expr {
                if !rows.contains(&(weight, row)) {
                    rows.push((weight, row));
                }
            }
        }
        rows
    }
}

/// The scalars scalar expression `e` reads.
pub fn scalar_deps(e: &ScalarExpr) -> Vec<ScalarId> {
    match e {
        ScalarExpr::Map { args, .. } => args.clone(),
        ScalarExpr::ChildSum(s) => vec![*s],
        _ => Vec::new(),
    }
}

/// The vectors scalar expression `e` reads.
pub fn scalar_vectors(e: &ScalarExpr) -> Vec<VecId> {
    match e {
        ScalarExpr::Dot { input, .. } | ScalarExpr::ColumnDot { input, .. } => vec![*input],
        ScalarExpr::RowDot { matrix, vector, .. } => vec![*matrix, *vector],
        ScalarExpr::Read { src, .. } => vec![*src],
        _ => Vec::new(),
    }
}

/// The vectors vector expression `e` reads.
pub fn vec_deps(e: &VecExpr) -> Vec<VecId> {
    match e {
        VecExpr::Slice { src, .. } | VecExpr::SumChildren(src) | VecExpr::Parent(src) => {
            vec![*src]
        }
        VecExpr::Concat { parts } => parts.iter().map(|&(p, _)| p).collect(),
        VecExpr::Map { args, .. } => args.clone(),
        _ => Vec::new(),
    }
}

/// A node the lowering (or the CPU evaluation of its program) cannot handle.
pub fn unsupported(g: &Graph, n: NodeId, why: impl Into<String>) -> CoreError {
    CoreError::Shape {
        context: "compiled-engine lowering".into(),
        op: g.nodes[n].describe(&[]),
        message: format!("node %{n}: {}", why.into()),
    }
}
