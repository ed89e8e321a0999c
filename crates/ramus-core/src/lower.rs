//! Cortex lowering: a vertex function's (or the head's) inference graph as
//! a **cell program** of per-unit scalar code, the form the compiled
//! inference engines run (Cortex §4.3–§5: fused cells, model persistence).
//!
//! # Vectors and units
//!
//! Every value the outputs need is one of two kinds:
//!
//! * a **vector** ([`VecNode`]): computed from the vertex's inputs (its
//!   children's states, its token's embedding) through data movement and
//!   elementwise ops only, no product. Any column of it can be evaluated on
//!   its own ([`VecExpr`]), so an engine evaluates exactly the columns it
//!   needs where it needs them (the lanes of a matrix-vector product read
//!   their own slice of the input, nothing is stored);
//! * a **unit value**: anything downstream of a matrix-vector product. Its
//!   columns are split into `units` interleaved **units**: unit `j` owns
//!   columns `j, U + j, 2U + j, …` of every unit value (`U` = `units`, the
//!   greatest common divisor of every unit value's width and every slice and
//!   concat boundary on them), and no column of one unit depends on another
//!   unit's. Each unit value of width `L·U` becomes `L` **scalars**
//!   ([`ScalarNode`], one per lane `m`: column `m·U + j`), all units running
//!   the same scalar code with their own `j`.
//!
//! A Tree-LSTM cell becomes, for unit `j`: three dot products of the child
//! sum `h̃` with rows `j`, `U + j`, `2U + j` of `U_iou`, one dot product per
//! child with row `j` of `U_f`, and the gate arithmetic of column `j`. An
//! engine pins a unit's weight rows on chip (in registers) across all levels
//! and runs the units in parallel; nothing is stored but the new state.
//!
//! Slices and concats of unit values are pure renumbering (no code);
//! `sum_children` of an edge scalar is a loop over the child edges
//! ([`ScalarExpr::ChildSum`]); dropout masks are 1 at inference and
//! multiplications by them are folded away.
//!
//! # Per-row matrices
//!
//! A vertex may carry matrices in its state (an MV-RNN's `[p; vec(P)]`),
//! multiplied by [`RowMatMul`] products, which lower
//! to two more scalar forms:
//!
//! * a per-row matrix times a per-row vector (`B a`): unit `j`'s lane is
//!   row `row + j` of the matrix dotted with the whole vector
//!   ([`ScalarExpr::RowDot`]);
//! * a static matrix times a per-row matrix (`W_M [A; B]`): output column
//!   `i·n + c` is row `i` of the static matrix dotted with column `c` of the
//!   per-row matrix. The units split the columns `c` (so `U` divides `n`);
//!   a lane's row `i` is the same for every unit, so every unit reads the
//!   same parameter elements, and its own column of the per-row matrix
//!   ([`ScalarExpr::ColumnDot`]).
//!
//! Either operand may be a unit value, stored and read back as a vector
//! by a later stage like a product's input.
//!
//! # Stages
//!
//! A product whose input is itself a unit value (a TreeGRU's
//! `U_h Σ_k (r_k ⊙ h_k)`) needs every unit's columns of that input: the
//! cell gets a second **stage**. In stage 0 each unit stores its columns
//! into a per-vertex scratch row ([`CellProgram::stores`]); stage 1 reads the
//! row back as a vector ([`VecExpr::Staged`]). A value one stage computes
//! and a later one reads is carried through the scratch row the same way
//! (parameters and vector reads are simply read again), so no stage ever
//! needs another stage's registers: an engine may run the stages as separate
//! passes with a barrier between them.
//!
//! # Hoisting
//!
//! [`CellProgram::hoist_token_values`] moves the values that depend on the
//! vertex's token alone (an input projection `W x + b`) into a per-token
//! table an engine computes once at load.
//!
//! A graph that does not fit — an op without an elementwise form, a
//! non-parameter weight, a product of per-edge unit values — is an error
//! naming the node.

use std::collections::HashMap;

use crate::error::{CoreError, Result};
use crate::graph::{DType, Graph, NodeId, NodeKind, ParamId, Source, Space};
use crate::ops::{MatMul, Op, RowMatMul};

mod eval;
pub use eval::{map_rows, MapOperand};

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

/// A program whose token-only values come from a per-token table, and the
/// program that computes that table (see [`CellProgram::hoist_token_values`]).
#[derive(Clone, Debug)]
pub struct Hoisted {
    /// The cell, reading the hoisted values from [`VecExpr::TokenTable`].
    pub program: CellProgram,
    /// One output: the hoisted values of a token, side by side (`width`
    /// columns), for a vertex with that token and no children.
    pub table: CellProgram,
    pub width: usize,
}

impl CellProgram {
    /// Computation hoisting (Cortex §4.3): the vertex scalars that depend on
    /// the vertex's token alone (an input projection `W x + b` of its word
    /// vector, and anything computed from only such values), where a value
    /// that does not leaves them, are computed once per token into a table
    /// at load; the cell then reads them. `None` when nothing worth a table
    /// (a product or an op) depends on the token alone.
    pub fn hoist_token_values(&self) -> Option<Hoisted> {
        let mut vec_token = vec![false; self.vectors.len()];
        for (v, node) in self.vectors.iter().enumerate() {
            vec_token[v] = node.scope == Scope::Vertex
                && match &node.expr {
                    VecExpr::Embedding { .. }
                    | VecExpr::EmbeddingUnk { .. }
                    | VecExpr::One
                    | VecExpr::Param(_) => true,
                    VecExpr::Slice { src, .. } => vec_token[*src],
                    VecExpr::Concat { parts } => parts.iter().all(|&(p, _)| vec_token[p]),
                    VecExpr::Map { args, .. } => args.iter().all(|&a| vec_token[a]),
                    _ => false,
                };
        }
        let mut token_only = vec![false; self.scalars.len()];
        for (id, s) in self.scalars.iter().enumerate() {
            token_only[id] = s.scope == Scope::Vertex
                && match &s.expr {
                    ScalarExpr::Dot { input, .. } | ScalarExpr::ColumnDot { input, .. } => {
                        vec_token[*input]
                    }
                    ScalarExpr::RowDot { matrix, vector, .. } => {
                        vec_token[*matrix] && vec_token[*vector]
                    }
                    ScalarExpr::Read { src, .. } => vec_token[*src],
                    ScalarExpr::Param { .. } => true,
                    ScalarExpr::Map { args, .. } => args.iter().all(|&a| token_only[a]),
                    ScalarExpr::ChildSum(_) => false,
                };
        }
        // the frontier: token-only values read by other values or output,
        // unless they are mere reads (nothing to save)
        let mut read_outside = vec![false; self.scalars.len()];
        for (id, s) in self.scalars.iter().enumerate() {
            if !token_only[id] {
                for d in scalar_deps(&s.expr) {
                    read_outside[d] = true;
                }
            }
        }
        for lanes in &self.outputs {
            for &s in lanes {
                read_outside[s] = true;
            }
        }
        let frontier: Vec<ScalarId> = (0..self.scalars.len())
            .filter(|&id| {
                token_only[id]
                    && read_outside[id]
                    && matches!(
                        self.scalars[id].expr,
                        ScalarExpr::Dot { .. }
                            | ScalarExpr::RowDot { .. }
                            | ScalarExpr::ColumnDot { .. }
                            | ScalarExpr::Map { .. }
                    )
            })
            .collect();
        if frontier.is_empty() {
            return None;
        }
        let u = self.units;
        let width = frontier.len() * u;
        let mut table = self.clone();
        table.outputs = vec![frontier.clone()];
        let mut program = self.clone();
        program.vectors.push(VecNode {
            expr: VecExpr::TokenTable,
            width,
            scope: Scope::Vertex,
            stage: 0,
        });
        let t = program.vectors.len() - 1;
        for (q, &id) in frontier.iter().enumerate() {
            program.scalars[id].expr = ScalarExpr::Read { src: t, col: q * u };
        }
        Some(Hoisted {
            program: program.compact(),
            table: table.compact(),
            width,
        })
    }

    /// Marks everything the live scalars and vectors read as live.
    fn mark_live(&self, live_s: &mut [bool], live_v: &mut [bool]) {
        for id in (0..self.scalars.len()).rev() {
            if !live_s[id] {
                continue;
            }
            for d in scalar_deps(&self.scalars[id].expr) {
                live_s[d] = true;
            }
            for v in scalar_vectors(&self.scalars[id].expr) {
                live_v[v] = true;
            }
        }
        for v in (0..self.vectors.len()).rev() {
            if live_v[v] {
                for d in vec_deps(&self.vectors[v].expr) {
                    live_v[d] = true;
                }
            }
        }
    }

    /// The program without the vectors and scalars no output needs,
    /// renumbered in order.
    pub fn compact(&self) -> CellProgram {
        let mut live_s = vec![false; self.scalars.len()];
        let mut live_v = vec![false; self.vectors.len()];
        for lanes in &self.outputs {
            for &s in lanes {
                live_s[s] = true;
            }
        }
        // a store is live when a live vector reads its columns, and a later
        // stage's read can make an earlier stage's store live: iterate
        loop {
            self.mark_live(&mut live_s, &mut live_v);
            let mut changed = false;
            for &(sc, col) in self.stores.iter().flatten() {
                let read = self.vectors.iter().enumerate().any(|(v, node)| {
                    live_v[v]
                        && matches!(node.expr, VecExpr::Staged { slot } if slot <= col && col < slot + node.width)
                });
                if read && !live_s[sc] {
                    live_s[sc] = true;
                    changed = true;
                }
            }
            if !changed {
                break;
            }
        }
        let renumber = |live: &[bool]| {
            let mut map = vec![usize::MAX; live.len()];
            let mut next = 0;
            for (i, &l) in live.iter().enumerate() {
                if l {
                    map[i] = next;
                    next += 1;
                }
            }
            map
        };
        let (vmap, smap) = (renumber(&live_v), renumber(&live_s));
        let vectors = self
            .vectors
            .iter()
            .enumerate()
            .filter(|&(v, _)| live_v[v])
            .map(|(_, node)| {
                let expr = match &node.expr {
                    VecExpr::Slice { src, offset } => VecExpr::Slice {
                        src: vmap[*src],
                        offset: *offset,
                    },
                    VecExpr::Concat { parts } => VecExpr::Concat {
                        parts: parts.iter().map(|&(p, w)| (vmap[p], w)).collect(),
                    },
                    VecExpr::Map { op, node, args } => VecExpr::Map {
                        op: op.clone(),
                        node: *node,
                        args: args.iter().map(|&a| vmap[a]).collect(),
                    },
                    VecExpr::SumChildren(src) => VecExpr::SumChildren(vmap[*src]),
                    VecExpr::Parent(src) => VecExpr::Parent(vmap[*src]),
                    other => other.clone(),
                };
                VecNode {
                    expr,
                    ..node.clone()
                }
            })
            .collect();
        let scalars = self
            .scalars
            .iter()
            .enumerate()
            .filter(|&(id, _)| live_s[id])
            .map(|(_, s)| {
                let expr = match &s.expr {
                    ScalarExpr::Dot {
                        weight,
                        row,
                        input,
                        k,
                    } => ScalarExpr::Dot {
                        weight: *weight,
                        row: *row,
                        input: vmap[*input],
                        k: *k,
                    },
                    ScalarExpr::Read { src, col } => ScalarExpr::Read {
                        src: vmap[*src],
                        col: *col,
                    },
                    ScalarExpr::RowDot {
                        matrix,
                        row,
                        vector,
                        k,
                    } => ScalarExpr::RowDot {
                        matrix: vmap[*matrix],
                        row: *row,
                        vector: vmap[*vector],
                        k: *k,
                    },
                    ScalarExpr::ColumnDot {
                        input,
                        weight,
                        base,
                        step,
                        offset,
                        stride,
                        k,
                    } => ScalarExpr::ColumnDot {
                        input: vmap[*input],
                        weight: *weight,
                        base: *base,
                        step: *step,
                        offset: *offset,
                        stride: *stride,
                        k: *k,
                    },
                    ScalarExpr::Map { op, node, args } => ScalarExpr::Map {
                        op: op.clone(),
                        node: *node,
                        args: args.iter().map(|&a| smap[a]).collect(),
                    },
                    ScalarExpr::ChildSum(src) => ScalarExpr::ChildSum(smap[*src]),
                    other => other.clone(),
                };
                ScalarNode {
                    expr,
                    scope: s.scope,
                    stage: s.stage,
                }
            })
            .collect();
        CellProgram {
            units: self.units,
            vectors,
            scalars,
            outputs: self
                .outputs
                .iter()
                .map(|lanes| lanes.iter().map(|&s| smap[s]).collect())
                .collect(),
            stages: self.stages,
            stores: self
                .stores
                .iter()
                .map(|stage| {
                    stage
                        .iter()
                        .filter(|&&(sc, _)| live_s[sc])
                        .map(|&(sc, col)| (smap[sc], col))
                        .collect()
                })
                .collect(),
            scratch_width: self.scratch_width,
        }
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

/// The error for node `n` of `g` that the lowering (or the reference
/// evaluation of its program) cannot handle.
pub fn unsupported(g: &Graph, n: NodeId, why: impl Into<String>) -> CoreError {
    CoreError::Shape {
        context: "compiled-engine lowering".into(),
        op: g.nodes[n].describe(&[]),
        message: format!("node %{n}: {}", why.into()),
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn space_scope(space: Space) -> Scope {
    if space == Space::Edge {
        Scope::Edge
    } else {
        Scope::Vertex
    }
}

/// What a graph node lowers to.
#[derive(Clone, Debug)]
enum Lowered {
    /// A vector.
    Vector(VecId),
    /// A static parameter (read per column where used).
    Param(ParamId),
    /// An index row (the token).
    Token,
    /// A unit value: one scalar per lane.
    Unit(Vec<ScalarId>),
}

struct Lowering<'g> {
    g: &'g Graph,
    units: usize,
    vectors: Vec<VecNode>,
    scalars: Vec<ScalarNode>,
    values: Vec<Option<Lowered>>,
    one: Option<VecId>,
    reads: HashMap<(VecId, usize), ScalarId>,
    params: HashMap<(ParamId, usize), ScalarId>,
    /// The scratch vector of each unit value a product reads.
    staged: HashMap<NodeId, VecId>,
    /// Scalars re-read or carried into a later stage (see `at_stage`).
    carried: HashMap<(ScalarId, usize), ScalarId>,
    stores: Vec<Vec<(ScalarId, usize)>>,
    scratch_width: usize,
}

/// Lowers the nodes `outputs` of inference graph `g` (a vertex function's
/// forward graph, or a head's) to a cell program; see the module docs.
pub fn lower(g: &Graph, outputs: &[NodeId]) -> Result<CellProgram> {
    let n = g.nodes.len();
    let mut needed = vec![false; n];
    for &o in outputs {
        if o >= n {
            return Err(CoreError::Shape {
                context: "compiled-engine lowering".into(),
                op: "outputs".into(),
                message: format!("output node %{o} does not exist (the graph has {n} nodes)"),
            });
        }
        needed[o] = true;
    }
    for i in (0..n).rev() {
        if needed[i] {
            for &x in &g.nodes[i].inputs {
                needed[x] = true;
            }
        }
    }
    let unit_class = classify(g, &needed);
    let units = unit_count(g, &needed, &unit_class, outputs)?;
    let mut l = Lowering {
        g,
        units,
        vectors: Vec::new(),
        scalars: Vec::new(),
        values: vec![None; n],
        one: None,
        reads: HashMap::new(),
        params: HashMap::new(),
        staged: HashMap::new(),
        carried: HashMap::new(),
        stores: Vec::new(),
        scratch_width: 0,
    };
    for i in (0..n).filter(|&i| needed[i]) {
        let value = l.lower_node(i, unit_class[i])?;
        l.values[i] = Some(value);
    }
    let mut lanes = Vec::with_capacity(outputs.len());
    for &o in outputs {
        lanes.push(l.lanes(o)?);
    }
    let stages = 1 + l.scalars.iter().map(|s| s.stage).max().unwrap_or(0);
    let mut stores = l.stores;
    stores.resize(stages, Vec::new());
    Ok(CellProgram {
        units,
        vectors: l.vectors,
        scalars: l.scalars,
        outputs: lanes,
        stages,
        stores,
        scratch_width: l.scratch_width,
    })
}

/// A model's cells for a compiled engine: the function run on leaves, the
/// one run on internal vertices (the same for a single-function model),
/// and the head.
#[derive(Clone, Debug)]
pub struct ModelCells {
    /// Function index and cell (outputs: scattered state, pushed value).
    pub leaf: (usize, CellProgram),
    pub internal: (usize, CellProgram),
    /// The head's scores.
    pub head: CellProgram,
    /// Rows of the embedding table the cells read, if they read a token.
    pub vocab: Option<usize>,
}

/// Lowers `model` for a compiled engine: its leaf and internal vertex
/// functions (each must scatter a state and push a value) and its head's
/// scores.
pub fn lower_model(model: &crate::Model) -> Result<ModelCells> {
    let err = |message: String| CoreError::Shape {
        context: "compiled-engine lowering".into(),
        op: model.name.clone(),
        message,
    };
    let (leaf, internal) = match model.selector {
        crate::FunctionSelector::LeafInternal { leaf, internal } => (leaf, internal),
        crate::FunctionSelector::Single(f) => (f, f),
        crate::FunctionSelector::ByKind(_) => {
            return Err(err(
                "the compiled engines run one leaf and one internal function; this model \
                 selects its functions by vertex kind (use the batched engine)"
                    .into(),
            ))
        }
    };
    let cell = |f: usize| -> Result<(usize, CellProgram)> {
        let func = model.functions.get(f).ok_or_else(|| {
            err(format!(
                "the selector names function {f}, which does not exist"
            ))
        })?;
        let (Some(scatter), Some(push)) = (func.scatter, func.push) else {
            return Err(err(format!(
                "function `{}` must scatter a state and push a value to be compiled",
                func.name
            )));
        };
        Ok((f, lower(&func.forward, &[scatter, push])?))
    };
    let (leaf, internal) = (cell(leaf)?, cell(internal)?);
    let logits = model
        .head
        .logits
        .ok_or_else(|| err("the head computes no scores".into()))?;
    let head = lower(&model.head.forward, &[logits])?;
    let embedding_rows = |program: &CellProgram| {
        program.vectors.iter().find_map(|v| match v.expr {
            VecExpr::Embedding { table } => model
                .params
                .get(table)
                .and_then(|p| p.shape.first().copied()),
            _ => None,
        })
    };
    let vocab = embedding_rows(&leaf.1).or_else(|| embedding_rows(&internal.1));
    Ok(ModelCells {
        leaf,
        internal,
        head,
        vocab,
    })
}

/// Marks unit values: products and everything computed from one.
fn classify(g: &Graph, needed: &[bool]) -> Vec<bool> {
    let mut unit = vec![false; g.nodes.len()];
    for (i, node) in g.nodes.iter().enumerate() {
        if !needed[i] {
            continue;
        }
        if matches!(node.op(), Some(Op::MatMul(_) | Op::RowMatMul(_))) {
            // (a product of a unit value is a new stage: see `Lowering::staged`)
            unit[i] = true;
        } else {
            unit[i] = node.inputs.iter().any(|&x| unit[x]);
        }
    }
    unit
}

/// The unit count: the gcd of every unit value's width and of the slice
/// and concat boundaries on unit values (of the output widths when no
/// product feeds the outputs).
fn unit_count(g: &Graph, needed: &[bool], unit: &[bool], outputs: &[NodeId]) -> Result<usize> {
    let mut u = 0;
    for (i, node) in g.nodes.iter().enumerate() {
        if !needed[i] || !unit[i] {
            continue;
        }
        u = gcd(u, node.ty.width());
        match node.op() {
            Some(Op::Slice(s)) => u = gcd(gcd(u, s.start), s.len),
            Some(Op::Concat(_)) => {
                for &x in &node.inputs {
                    u = gcd(u, g.nodes[x].ty.width());
                }
            }
            // a static matrix times per-row matrices: the units split the columns
            Some(Op::RowMatMul(rm))
                if node
                    .inputs
                    .first()
                    .is_some_and(|&a| !g.nodes[a].ty.is_rows()) =>
            {
                u = gcd(u, rm.n)
            }
            _ => {}
        }
    }
    if u == 0 {
        // no product: the outputs are vectors, read per unit column
        u = outputs
            .iter()
            .fold(0, |u, &o| gcd(u, g.nodes[o].ty.width()));
    }
    if u == 0 {
        return Err(CoreError::Shape {
            context: "compiled-engine lowering".into(),
            op: "cell".into(),
            message: format!("the outputs {outputs:?} have no columns"),
        });
    }
    for &o in outputs {
        if !g.nodes[o].ty.width().is_multiple_of(u) {
            return Err(unsupported(
                g,
                o,
                format!("output width is not a multiple of the {u} units"),
            ));
        }
    }
    Ok(u)
}

impl Lowering<'_> {
    fn value(&self, x: NodeId) -> Result<&Lowered> {
        self.values[x]
            .as_ref()
            .ok_or_else(|| unsupported(self.g, x, "used before it was lowered"))
    }

    fn vec(&mut self, expr: VecExpr, width: usize, scope: Scope) -> VecId {
        let stage = vec_deps(&expr)
            .into_iter()
            .map(|d| self.vectors[d].stage)
            .max()
            .unwrap_or(0);
        self.vectors.push(VecNode {
            expr,
            width,
            scope,
            stage,
        });
        self.vectors.len() - 1
    }

    fn scalar(&mut self, expr: ScalarExpr, scope: Scope) -> ScalarId {
        let stage = match &expr {
            e @ (ScalarExpr::Dot { .. }
            | ScalarExpr::RowDot { .. }
            | ScalarExpr::ColumnDot { .. }
            | ScalarExpr::Read { .. }) => scalar_vectors(e)
                .into_iter()
                .map(|v| self.vectors[v].stage)
                .max()
                .unwrap_or(0),
            other => scalar_deps(other)
                .into_iter()
                .map(|d| self.scalars[d].stage)
                .max()
                .unwrap_or(0),
        };
        self.scalars.push(ScalarNode { expr, scope, stage });
        self.scalars.len() - 1
    }

    /// Scalar `x` for use in (later) stage `stage`: itself in its own stage;
    /// a read (of a parameter or a vector) re-read there; anything else
    /// stored to the scratch row by its stage and read back.
    fn at_stage(&mut self, x: ScalarId, stage: usize) -> Result<ScalarId> {
        let node = &self.scalars[x];
        if node.stage == stage {
            return Ok(x);
        }
        if let Some(&c) = self.carried.get(&(x, stage)) {
            return Ok(c);
        }
        let copy = match node.expr {
            ScalarExpr::Param { .. } | ScalarExpr::Read { .. } => node.expr.clone(),
            _ => {
                if node.scope != Scope::Vertex {
                    return Err(CoreError::Shape {
                        context: "compiled-engine lowering".into(),
                        op: "cell".into(),
                        message: "a per-edge value read by a later stage is not supported".into(),
                    });
                }
                let from = node.stage;
                let slot = self.scratch_width;
                self.scratch_width += self.units;
                if self.stores.len() <= from {
                    self.stores.resize(from + 1, Vec::new());
                }
                self.stores[from].push((x, slot));
                self.vectors.push(VecNode {
                    expr: VecExpr::Staged { slot },
                    width: self.units,
                    scope: Scope::Vertex,
                    stage: from + 1,
                });
                ScalarExpr::Read {
                    src: self.vectors.len() - 1,
                    col: 0,
                }
            }
        };
        let scope = self.scalars[x].scope;
        self.scalars.push(ScalarNode {
            expr: copy,
            scope,
            stage,
        });
        let c = self.scalars.len() - 1;
        self.carried.insert((x, stage), c);
        Ok(c)
    }

    /// The scratch vector holding unit value `x` (stored by its stage, read
    /// from the next).
    fn staged(&mut self, x: NodeId) -> Result<VecId> {
        if let Some(&v) = self.staged.get(&x) {
            return Ok(v);
        }
        if self.g.nodes[x].ty.space != Space::Vertex {
            return Err(unsupported(
                self.g,
                x,
                "a product of per-edge unit values is not supported",
            ));
        }
        let lanes = self.lanes(x)?;
        let stage = lanes
            .iter()
            .map(|&l| self.scalars[l].stage)
            .max()
            .unwrap_or(0);
        let slot = self.scratch_width;
        if self.stores.len() <= stage {
            self.stores.resize(stage + 1, Vec::new());
        }
        for (m, &l) in lanes.iter().enumerate() {
            self.stores[stage].push((l, slot + m * self.units));
        }
        let width = lanes.len() * self.units;
        self.scratch_width += width;
        self.vectors.push(VecNode {
            expr: VecExpr::Staged { slot },
            width,
            scope: Scope::Vertex,
            stage: stage + 1,
        });
        let v = self.vectors.len() - 1;
        self.staged.insert(x, v);
        Ok(v)
    }

    fn vector_of(&self, x: NodeId) -> Result<VecId> {
        match self.value(x)? {
            Lowered::Vector(v) => Ok(*v),
            _ => Err(unsupported(self.g, x, "expected a vector value here")),
        }
    }

    /// Node `x`'s lanes: its scalars, or reads of a vector / parameter.
    fn lanes(&mut self, x: NodeId) -> Result<Vec<ScalarId>> {
        let width = self.g.nodes[x].ty.width();
        if !width.is_multiple_of(self.units) {
            return Err(unsupported(
                self.g,
                x,
                format!(
                    "width {width} is not a multiple of the {} units",
                    self.units
                ),
            ));
        }
        let lanes = width / self.units;
        match self.value(x)?.clone() {
            Lowered::Unit(s) => Ok(s),
            Lowered::Vector(v) => Ok((0..lanes).map(|m| self.read(v, m * self.units)).collect()),
            Lowered::Param(p) => {
                if self.g.nodes[x].ty.shape.len() != 1 {
                    return Err(unsupported(
                        self.g,
                        x,
                        "only a parameter row (a bias) is read per unit",
                    ));
                }
                Ok((0..lanes)
                    .map(|m| self.param_read(p, m * self.units))
                    .collect())
            }
            Lowered::Token => Err(unsupported(self.g, x, "a token is not a float value")),
        }
    }

    fn read(&mut self, src: VecId, col: usize) -> ScalarId {
        if let Some(&s) = self.reads.get(&(src, col)) {
            return s;
        }
        let scope = self.vectors[src].scope;
        let s = self.scalar(ScalarExpr::Read { src, col }, scope);
        self.reads.insert((src, col), s);
        s
    }

    fn param_read(&mut self, param: ParamId, col: usize) -> ScalarId {
        if let Some(&s) = self.params.get(&(param, col)) {
            return s;
        }
        let s = self.scalar(ScalarExpr::Param { param, col }, Scope::Vertex);
        self.params.insert((param, col), s);
        s
    }

    fn is_one(&self, x: NodeId) -> bool {
        matches!(self.values[x], Some(Lowered::Vector(v)) if Some(v) == self.one)
    }

    fn lower_node(&mut self, i: NodeId, unit: bool) -> Result<Lowered> {
        let g = self.g;
        let node = &g.nodes[i];
        let scope = space_scope(node.ty.space);
        let width = node.ty.width();
        let op = match &node.kind {
            NodeKind::Param(p) => return Ok(Lowered::Param(*p)),
            NodeKind::Input(source) => {
                let expr = match *source {
                    Source::Gather(k) => VecExpr::ChildState(ChildRef::Index(k)),
                    Source::GatherAll => VecExpr::ChildState(ChildRef::Edge),
                    Source::HeadInput => VecExpr::HeadInput,
                    Source::Token => return Ok(Lowered::Token),
                    Source::DropoutMask { .. } => {
                        let one = self.vec(VecExpr::One, width, scope);
                        self.one = Some(one);
                        return Ok(Lowered::Vector(one));
                    }
                    _ => {
                        return Err(unsupported(
                            g,
                            i,
                            "this input is not available to the compiled engine",
                        ))
                    }
                };
                return Ok(Lowered::Vector(self.vec(expr, width, scope)));
            }
            NodeKind::Op(op) => op.clone(),
        };
        if node.ty.dtype != DType::Float {
            return Err(unsupported(g, i, "only float values are lowered"));
        }
        let args = &node.inputs;
        // multiplying by an inference dropout mask (1) is the identity
        if matches!(op, Op::Mul(_)) {
            if let [a, b] = args[..] {
                let keep = if self.is_one(b) {
                    Some(a)
                } else if self.is_one(a) {
                    Some(b)
                } else {
                    None
                };
                if let Some(x) = keep {
                    return Ok(self.value(x)?.clone());
                }
            }
        }
        if unit {
            return self.lower_unit(i, op);
        }
        let expr = match &op {
            Op::Embedding(_) => VecExpr::Embedding {
                table: self.embedding_table(i)?,
            },
            Op::EmbeddingUnk(_) => VecExpr::EmbeddingUnk {
                table: self.embedding_table(i)?,
                rows: g.nodes[args[0]].ty.shape[0],
            },
            Op::Slice(s) => VecExpr::Slice {
                src: self.vector_of(args[0])?,
                offset: s.start,
            },
            Op::Concat(_) => {
                let parts = args
                    .iter()
                    .map(|&x| Ok((self.vector_of(x)?, g.nodes[x].ty.width())))
                    .collect::<Result<_>>()?;
                VecExpr::Concat { parts }
            }
            Op::SumChildren(_) => VecExpr::SumChildren(self.vector_of(args[0])?),
            Op::ExpandChildren(_) => VecExpr::Parent(self.vector_of(args[0])?),
            crate::elementwise_op!() => {
                let mut vs = Vec::with_capacity(args.len());
                for &x in args {
                    vs.push(match self.value(x)?.clone() {
                        Lowered::Vector(v) => v,
                        Lowered::Param(p) => {
                            let w = g.nodes[x].ty.width();
                            self.vec(VecExpr::Param(p), w, Scope::Vertex)
                        }
                        _ => return Err(unsupported(g, i, "an operand is not a float vector")),
                    });
                }
                VecExpr::Map {
                    op,
                    node: i,
                    args: vs,
                }
            }
            // products are unit values (`classify`), lowered by `lower_unit`
            Op::MatMul(_)
            | Op::RowMatMul(_)
            | Op::Pad(_)
            | Op::SumRows(_)
            | Op::BroadcastRows(_)
            | Op::Reshape(_)
            | Op::EmbeddingUnkBackward(_)
            | Op::SoftmaxXent(_)
            | Op::SoftmaxXentBackward(_)
            | crate::image_op!() => {
                return Err(unsupported(
                    g,
                    i,
                    "this op has no per-column form for the compiled engine",
                ))
            }
        };
        Ok(Lowered::Vector(self.vec(expr, width, scope)))
    }

    /// The parameter table embedding node `i` looks up by the vertex token.
    fn embedding_table(&mut self, i: NodeId) -> Result<ParamId> {
        let g = self.g;
        let args = &g.nodes[i].inputs;
        match (self.value(args[0])?, self.value(args[1])?) {
            (Lowered::Param(p), Lowered::Token) => Ok(*p),
            _ => Err(unsupported(
                g,
                i,
                "an embedding must look a parameter table up by the vertex token",
            )),
        }
    }

    /// Per-row operand `x` of a product as a vector (a unit value is
    /// stored by its stage and read back by the next).
    fn product_input(&mut self, x: NodeId) -> Result<VecId> {
        match self.value(x)? {
            Lowered::Unit(_) => self.staged(x),
            _ => self.vector_of(x),
        }
    }

    /// A per-row matrix product (see the module docs): a per-row matrix
    /// times a per-row vector, or a static matrix times a per-row matrix.
    fn lower_row_matmul(&mut self, i: NodeId, rm: &RowMatMul) -> Result<Lowered> {
        let g = self.g;
        let node = &g.nodes[i];
        let (a, b) = (node.inputs[0], node.inputs[1]);
        let scope = space_scope(node.ty.space);
        let u = self.units;
        let lanes = node.ty.width() / u;
        if rm.trans_b {
            return Err(unsupported(
                g,
                i,
                "a per-row product with a transposed right operand is not lowered",
            ));
        }
        if let Lowered::Param(weight) = *self.value(a)? {
            if !rm.n.is_multiple_of(u) {
                return Err(unsupported(
                    g,
                    i,
                    format!("{} columns do not split over the {u} units", rm.n),
                ));
            }
            let input = self.product_input(b)?;
            let dots = (0..lanes)
                .map(|l| {
                    let (row, col) = ((l * u) / rm.n, (l * u) % rm.n);
                    let (base, step) = if rm.trans_a {
                        (row, rm.m)
                    } else {
                        (row * rm.k, 1)
                    };
                    self.scalar(
                        ScalarExpr::ColumnDot {
                            weight,
                            base,
                            step,
                            input,
                            offset: col,
                            stride: rm.n,
                            k: rm.k,
                        },
                        scope,
                    )
                })
                .collect();
            return Ok(Lowered::Unit(dots));
        }
        if rm.n != 1 || rm.trans_a || matches!(self.value(b)?, Lowered::Param(_)) {
            return Err(unsupported(
                g,
                i,
                "per-row products lower as a static matrix times per-row matrices or a \
                 per-row matrix times a per-row vector (no transposes)",
            ));
        }
        let (matrix, vector) = (self.product_input(a)?, self.product_input(b)?);
        let dots = (0..lanes)
            .map(|l| {
                self.scalar(
                    ScalarExpr::RowDot {
                        matrix,
                        row: l * u,
                        vector,
                        k: rm.k,
                    },
                    scope,
                )
            })
            .collect();
        Ok(Lowered::Unit(dots))
    }

    fn lower_unit(&mut self, i: NodeId, op: Op) -> Result<Lowered> {
        let g = self.g;
        let node = &g.nodes[i];
        let args = &node.inputs;
        let u = self.units;
        let lanes = node.ty.width() / u;
        match &op {
            Op::MatMul(mm) => self.lower_dot(i, mm),
            Op::RowMatMul(rm) => self.lower_row_matmul(i, rm),
            Op::Slice(s) => {
                let src = self.lanes(args[0])?;
                Ok(Lowered::Unit(
                    src[s.start / u..(s.start + s.len) / u].to_vec(),
                ))
            }
            Op::Concat(_) => {
                let mut all = Vec::with_capacity(lanes);
                for &x in args {
                    all.extend(self.lanes(x)?);
                }
                Ok(Lowered::Unit(all))
            }
            Op::SumChildren(_) => {
                let src = self.lanes(args[0])?;
                let sums = src
                    .into_iter()
                    .map(|s| self.scalar(ScalarExpr::ChildSum(s), Scope::Vertex))
                    .collect();
                Ok(Lowered::Unit(sums))
            }
            // an edge reads its vertex's scalars directly
            Op::ExpandChildren(_) => Ok(Lowered::Unit(self.lanes(args[0])?)),
            crate::elementwise_op!() => self.lower_unit_map(i, &op),
            Op::Pad(_)
            | Op::SumRows(_)
            | Op::BroadcastRows(_)
            | Op::Reshape(_)
            | Op::Embedding(_)
            | Op::EmbeddingUnk(_)
            | Op::EmbeddingUnkBackward(_)
            | Op::SoftmaxXent(_)
            | Op::SoftmaxXentBackward(_)
            | crate::image_op!() => Err(unsupported(
                g,
                i,
                "this op has no per-unit form for the compiled engine",
            )),
        }
    }

    /// A unit product `x·Wᵀ` ([`MatMul`] with a `[out, in]` weight): one
    /// dot product per unit lane.
    fn lower_dot(&mut self, i: NodeId, mm: &MatMul) -> Result<Lowered> {
        let g = self.g;
        let node = &g.nodes[i];
        let args = &node.inputs;
        let scope = space_scope(node.ty.space);
        let u = self.units;
        let lanes = node.ty.width() / u;
        let input = self.product_input(args[0])?;
        let weight = match self.value(args[1])? {
            Lowered::Param(p) => *p,
            _ => return Err(unsupported(g, i, "the weight must be a parameter")),
        };
        let wty = &g.nodes[args[1]].ty;
        if mm.trans_a || !mm.trans_b || wty.shape.len() != 2 {
            return Err(unsupported(
                g,
                i,
                "only products x·Wᵀ with a [out, in] weight are lowered",
            ));
        }
        let k = wty.shape[1];
        let dots = (0..lanes)
            .map(|m| {
                self.scalar(
                    ScalarExpr::Dot {
                        weight,
                        row: m * u,
                        input,
                        k,
                    },
                    scope,
                )
            })
            .collect();
        Ok(Lowered::Unit(dots))
    }

    /// An elementwise op on unit values: the op applied lane by lane.
    fn lower_unit_map(&mut self, i: NodeId, op: &Op) -> Result<Lowered> {
        let g = self.g;
        let node = &g.nodes[i];
        let args = &node.inputs;
        let scope = space_scope(node.ty.space);
        let lanes = node.ty.width() / self.units;
        let operands = args
            .iter()
            .map(|&x| self.lanes(x))
            .collect::<Result<Vec<_>>>()?;
        let mut out = Vec::with_capacity(lanes);
        for m in 0..lanes {
            let a = operands
                .iter()
                .map(|lanes| lanes.get(m).copied())
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| unsupported(g, i, "an operand is narrower than the result"))?;
            // every operand of a multi-stage op in its own stage: a stage's
            // code never reads another stage's registers
            let stage = a.iter().map(|&x| self.scalars[x].stage).max().unwrap_or(0);
            let a = a
                .into_iter()
                .map(|x| self.at_stage(x, stage))
                .collect::<Result<Vec<_>>>()?;
            out.push(self.scalar(
                ScalarExpr::Map {
                    op: op.clone(),
                    node: i,
                    args: a,
                },
                scope,
            ));
        }
        Ok(Lowered::Unit(out))
    }
}
