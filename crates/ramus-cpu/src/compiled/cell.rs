//! The compiled CPU engine's cell interpreter: a lowered cell run over a
//! level's rows at once ([`Cell::run`]: packed GEMMs for its dot products,
//! vectorized unit scalars, child sums over CSR edges), and the per-token
//! tables of leaf specialization ([`tabulate`]).

use ramus_core::lower::{
    scalar_vectors, vec_deps, CellProgram, ChildRef, ScalarExpr, Scope, VecExpr, VecNode,
};
use ramus_core::ops::matmul::PACKED_MAX_M;
use ramus_core::ops::{unk_row, Op};
use ramus_core::Params;
use ramus_graph::LinearBatch;

use crate::cell_eval::{map_rows, MapOperand};
use crate::kernels::{gemm_packed, PackedB};

use ramus_exec::{ExecError, Result};

/// An error in a batch or cell the compiled engine cannot run.
pub(super) fn err(message: impl Into<String>) -> ExecError {
    ExecError::Input(message.into())
}

/// A block of rows (`rows × width`, row-major), or one row broadcast to
/// every row (a parameter, a constant).
#[derive(Clone, Debug, Default)]
pub(super) struct Block {
    pub(super) rows: usize,
    pub(super) width: usize,
    pub(super) broadcast: bool,
    pub(super) data: Vec<f32>,
}

impl Block {
    /// Sizes the block for `rows × width` values the caller then writes
    /// in full (old contents are left in place, not cleared).
    pub(super) fn reset(&mut self, rows: usize, width: usize) {
        self.rows = rows;
        self.width = width;
        self.broadcast = false;
        self.data.resize(rows * width, 0.0);
    }
    /// Sizes the block for `rows × width` zeros.
    pub(super) fn reset_zeroed(&mut self, rows: usize, width: usize) {
        self.reset(rows, width);
        self.data.fill(0.0);
    }
    pub(super) fn set_broadcast(&mut self, row: &[f32]) {
        self.rows = 1;
        self.width = row.len();
        self.broadcast = true;
        self.data.clear();
        self.data.extend_from_slice(row);
    }
    pub(super) fn row(&self, r: usize) -> &[f32] {
        let r = if self.broadcast { 0 } else { r };
        &self.data[r * self.width..(r + 1) * self.width]
    }
}

/// The dot products of a cell that share an input vector and a weight:
/// their weight rows (`row..row + units` each, side by side) packed once, so
/// a level runs them as one GEMM (wide enough to split over two threads).
#[derive(Clone, Debug)]
pub(super) struct DotGroup {
    pub(super) input: usize,
    /// Member scalars, in packed column order.
    pub(super) members: Vec<usize>,
    pub(super) packed: PackedB<f32>,
}

/// A lowered cell with its packed weights and scratch.
pub(super) struct Cell {
    pub(super) program: CellProgram,
    pub(super) groups: Vec<DotGroup>,
    /// Group of each dot-product scalar.
    pub(super) group_of: Vec<Option<usize>>,
    pub(super) vecs: Vec<Block>,
    pub(super) scalars: Vec<Block>,
    /// A group's product, before it is split among its members.
    pub(super) product: Vec<f32>,
    /// Per-row scratch of a multi-stage cell (rows × scratch width).
    pub(super) scratch: Vec<f32>,
    /// Child-state vectors read only through slices: never materialized,
    /// the slices copy their columns from the child rows directly.
    pub(super) sliced_only: Vec<bool>,
    /// Hoisted token values, a row of `token_width` per token (empty
    /// without hoisting).
    pub(super) token_table: Vec<f32>,
    pub(super) token_width: usize,
}

impl Cell {
    pub(super) fn new(program: CellProgram, params: &Params<f32>) -> Result<Self> {
        let u = program.units;
        let mut keys: Vec<(usize, usize, Scope)> = Vec::new();
        let mut members: Vec<Vec<(usize, usize)>> = Vec::new();
        let mut group_of = vec![None; program.scalars.len()];
        for (id, s) in program.scalars.iter().enumerate() {
            if let ScalarExpr::Dot {
                weight, row, input, ..
            } = s.expr
            {
                let key = (input, weight, s.scope);
                let g = keys.iter().position(|&k| k == key).unwrap_or_else(|| {
                    keys.push(key);
                    members.push(Vec::new());
                    keys.len() - 1
                });
                members[g].push((id, row));
                group_of[id] = Some(g);
            }
        }
        let mut groups = Vec::with_capacity(keys.len());
        for (&(input, weight, _), rows) in keys.iter().zip(members) {
            let w = params
                .values
                .get(weight)
                .ok_or_else(|| err(format!("parameter {weight} missing")))?;
            let k = w.shape().get(1).copied().unwrap_or(0);
            let mut picked = Vec::with_capacity(rows.len() * u * k);
            for &(_, row) in &rows {
                let block = w.data().get(row * k..(row + u) * k).ok_or_else(|| {
                    err(format!("parameter {weight} has no rows {row}..{}", row + u))
                })?;
                picked.extend_from_slice(block);
            }
            // op(B) = pickedᵀ: k × (members · units)
            let packed = PackedB::pack(&picked, k, k, rows.len() * u, true);
            groups.push(DotGroup {
                input,
                members: rows.into_iter().map(|(id, _)| id).collect(),
                packed,
            });
        }
        // child states only sliced: the slices read the child rows
        let mut sliced_only: Vec<bool> = program
            .vectors
            .iter()
            .map(|v| matches!(v.expr, VecExpr::ChildState(_)))
            .collect();
        for v in &program.vectors {
            if !matches!(v.expr, VecExpr::Slice { .. }) {
                for d in vec_deps(&v.expr) {
                    sliced_only[d] = false;
                }
            }
        }
        for s in &program.scalars {
            for v in scalar_vectors(&s.expr) {
                sliced_only[v] = false;
            }
        }
        Ok(Cell {
            sliced_only,
            vecs: vec![Block::default(); program.vectors.len()],
            scalars: vec![Block::default(); program.scalars.len()],
            program,
            groups,
            group_of,
            product: Vec::new(),
            scratch: Vec::new(),
            token_table: Vec::new(),
            token_width: 0,
        })
    }
}

/// The nodes a cell runs on: a range of node numbers, or a list.
#[derive(Clone, Copy, Debug)]
pub(super) enum Nodes<'a> {
    Range(usize, usize),
    List(&'a [u32]),
}

impl Nodes<'_> {
    pub(super) fn len(&self) -> usize {
        match *self {
            Nodes::Range(a, b) => b - a,
            Nodes::List(l) => l.len(),
        }
    }
    /// Node number of row `r`.
    pub(super) fn get(&self, r: usize) -> usize {
        match *self {
            Nodes::Range(a, _) => a + r,
            Nodes::List(l) => l[r] as usize,
        }
    }
}

/// Where a cell's inputs come from for one level.
pub(super) struct LevelInputs<'a, 'r> {
    /// The level's nodes (their tokens and children).
    pub(super) nodes: Nodes<'a>,
    pub(super) batch: &'a LinearBatch,
    /// Child state row of a child node.
    pub(super) child_row: &'a dyn Fn(u32) -> &'r [f32],
    /// The head's input row of node `r` of the level (head cells).
    pub(super) head_input: Option<&'a dyn Fn(usize) -> &'r [f32]>,
    /// The token of node `r` of the level (overrides the batch; the table build).
    pub(super) token_of: Option<&'a dyn Fn(usize) -> u32>,
}

/// Blocks as operands of [`map_rows`].
pub(super) fn operands<'a>(blocks: &[&'a Block]) -> Vec<MapOperand<'a, f32>> {
    blocks
        .iter()
        .map(|b| (b.data.as_slice(), b.broadcast))
        .collect()
}

/// Repeats vertex rows of `src` for each edge (`parent[e]` = vertex row).
pub(super) fn expand(src: &Block, parent: &[u32], out: &mut Block) {
    if src.broadcast {
        out.set_broadcast(&src.data);
        return;
    }
    out.reset(parent.len(), src.width);
    for (e, &p) in parent.iter().enumerate() {
        let w = src.width;
        out.data[e * w..(e + 1) * w].copy_from_slice(src.row(p as usize));
    }
}

/// Sums edge rows of `src` per vertex (`offsets`: rows + 1, relative).
pub(super) fn segment_sum(src: &Block, offsets: &[u32], out: &mut Block) {
    let rows = offsets.len().saturating_sub(1);
    out.reset_zeroed(rows, src.width);
    let w = src.width;
    for r in 0..rows {
        let acc = &mut out.data[r * w..(r + 1) * w];
        for e in offsets[r] as usize..offsets[r + 1] as usize {
            for (a, x) in acc.iter_mut().zip(src.row(e)) {
                *a += *x;
            }
        }
    }
}

/// A level's child edges, relative to its rows (CSR): `offsets[r]..offsets[r + 1]`
/// are row `r`'s edges, `parent[e]` an edge's row, `child[e]` its child node.
struct LevelEdges {
    offsets: Vec<u32>,
    parent: Vec<u32>,
    child: Vec<u32>,
}

impl LevelEdges {
    /// The edges of `level`'s nodes (none for a table build).
    fn of(level: &LevelInputs<'_, '_>) -> Self {
        let rows = level.nodes.len();
        let mut edges = LevelEdges {
            offsets: Vec::with_capacity(rows + 1),
            parent: Vec::new(),
            child: Vec::new(),
        };
        edges.offsets.push(0u32);
        for r in 0..rows {
            let n = level.nodes.get(r);
            let kids = if level.token_of.is_some() {
                &[][..]
            } else {
                level.batch.children(n as u32)
            };
            for &c in kids {
                edges.parent.push(r as u32);
                edges.child.push(c);
            }
            edges.offsets.push(edges.child.len() as u32);
        }
        edges
    }

    fn len(&self) -> usize {
        self.child.len()
    }

    /// Row `r`'s `k`th child, if it has one.
    fn kth_child(&self, r: usize, k: usize) -> Option<u32> {
        let (a, b) = (self.offsets[r] as usize, self.offsets[r + 1] as usize);
        (a + k < b).then(|| self.child[a + k])
    }
}

/// What a cell's vectors read for one level besides each other: the
/// parameters, the level's inputs and edges, and the cell's tables.
struct VectorReads<'l, 'a, 'r> {
    params: &'l [Vec<f32>],
    level: &'l LevelInputs<'a, 'r>,
    edges: &'l LevelEdges,
    program: &'l CellProgram,
    sliced_only: &'l [bool],
    token_table: &'l [f32],
    token_width: usize,
    scratch: &'l [f32],
}

impl VectorReads<'_, '_, '_> {
    /// The token of row `r`.
    fn token(&self, r: usize) -> u32 {
        match self.level.token_of {
            Some(t) => t(r),
            None => self.level.batch.tokens()[self.level.nodes.get(r)],
        }
    }

    /// Computes vector `v` (`node`) into `out` from the vectors `before` it.
    fn vector(&self, v: usize, node: &VecNode, before: &[Block], out: &mut Block) -> Result<()> {
        match &node.expr {
            VecExpr::ChildState(ChildRef::Index(_)) => self.read(node, out),
            VecExpr::ChildState(_) if self.sliced_only[v] => Ok(()),
            VecExpr::Slice { src, offset } if self.sliced_only[*src] => {
                self.child_slice(*src, *offset, node.width, out)
            }
            VecExpr::Slice { .. }
            | VecExpr::Concat { .. }
            | VecExpr::Map { .. }
            | VecExpr::SumChildren(_)
            | VecExpr::Parent(_) => self.derived(node, before, out),
            _ => self.read(node, out),
        }
    }

    /// A vector read from outside the cell: child states, embedding and
    /// token-table rows, the head input, staged scratch, constants.
    fn read(&self, node: &VecNode, out: &mut Block) -> Result<()> {
        let (rows, w) = (self.level.nodes.len(), node.width);
        let params = self.params;
        match &node.expr {
            VecExpr::ChildState(ChildRef::Index(k)) => {
                out.reset_zeroed(rows, w);
                for r in 0..rows {
                    if let Some(c) = self.edges.kth_child(r, *k) {
                        let row = (self.level.child_row)(c);
                        out.data[r * w..(r + 1) * w].copy_from_slice(&row[..w]);
                    }
                }
            }
            VecExpr::ChildState(ChildRef::Edge) => {
                out.reset(self.edges.len(), w);
                for (e, &c) in self.edges.child.iter().enumerate() {
                    let row = (self.level.child_row)(c);
                    out.data[e * w..(e + 1) * w].copy_from_slice(&row[..w]);
                }
            }
            VecExpr::Embedding { table } => {
                out.reset(rows, w);
                let t = &params[*table];
                for r in 0..rows {
                    let tok = self.token(r) as usize;
                    let src = t
                        .get(tok * w..(tok + 1) * w)
                        .ok_or_else(|| err(format!("token {tok} beyond the embedding table")))?;
                    out.data[r * w..(r + 1) * w].copy_from_slice(src);
                }
            }
            VecExpr::EmbeddingUnk {
                table,
                rows: table_rows,
            } => {
                out.reset(rows, w);
                let t = &params[*table];
                for r in 0..rows {
                    let at = unk_row(self.token(r), *table_rows) * w;
                    let src = t.get(at..at + w).ok_or_else(|| {
                        err(format!(
                            "parameter {table} is shorter than its {table_rows} rows"
                        ))
                    })?;
                    out.data[r * w..(r + 1) * w].copy_from_slice(src);
                }
            }
            VecExpr::TokenTable => {
                out.reset(rows, w);
                for r in 0..rows {
                    let tok = self.token(r) as usize;
                    let at = tok * self.token_width;
                    let src = self
                        .token_table
                        .get(at..at + w)
                        .ok_or_else(|| err(format!("token {tok} beyond the token table")))?;
                    out.data[r * w..(r + 1) * w].copy_from_slice(src);
                }
            }
            VecExpr::HeadInput => {
                let h = self.level.head_input.ok_or_else(|| err("no head input"))?;
                out.reset(rows, w);
                for r in 0..rows {
                    out.data[r * w..(r + 1) * w].copy_from_slice(&h(r)[..w]);
                }
            }
            VecExpr::One => out.set_broadcast(&vec![1.0; w]),
            VecExpr::Staged { slot } => {
                let sw = self.program.scratch_width;
                out.reset(rows, w);
                for r in 0..rows {
                    out.data[r * w..(r + 1) * w]
                        .copy_from_slice(&self.scratch[r * sw + slot..r * sw + slot + w]);
                }
            }
            VecExpr::Param(p) => out.set_broadcast(&params[*p][..w]),
            _ => return Err(err("a derived vector read as an input")),
        }
        Ok(())
    }

    /// Columns `offset..offset + w` of the child rows of vector `src` (a
    /// child state read only through slices).
    fn child_slice(&self, src: usize, offset: usize, w: usize, out: &mut Block) -> Result<()> {
        let copy = |out: &mut Block, r: usize, c: u32| {
            let row = (self.level.child_row)(c);
            out.data[r * w..(r + 1) * w].copy_from_slice(&row[offset..offset + w]);
        };
        match self.program.vectors[src].expr {
            VecExpr::ChildState(ChildRef::Edge) => {
                out.reset(self.edges.len(), w);
                for (e, &c) in self.edges.child.iter().enumerate() {
                    copy(out, e, c);
                }
            }
            VecExpr::ChildState(ChildRef::Index(k)) => {
                let rows = self.level.nodes.len();
                out.reset_zeroed(rows, w);
                for r in 0..rows {
                    if let Some(c) = self.edges.kth_child(r, k) {
                        copy(out, r, c);
                    }
                }
            }
            _ => return Err(err("a direct slice of a non-child vector")),
        }
        Ok(())
    }

    /// A vector computed from earlier ones (`before`): slices, concats,
    /// maps, child sums, parent rows repeated per edge.
    fn derived(&self, node: &VecNode, before: &[Block], out: &mut Block) -> Result<()> {
        let w = node.width;
        let scope_rows = match node.scope {
            Scope::Edge => self.edges.len(),
            _ => self.level.nodes.len(),
        };
        match &node.expr {
            VecExpr::Slice { src, offset } => {
                let s = &before[*src];
                if s.broadcast {
                    out.set_broadcast(&s.data[*offset..*offset + w]);
                } else {
                    out.reset(s.rows, w);
                    for r in 0..s.rows {
                        out.data[r * w..(r + 1) * w]
                            .copy_from_slice(&s.row(r)[*offset..*offset + w]);
                    }
                }
            }
            VecExpr::Concat { parts } => {
                out.reset(scope_rows, w);
                let mut at = 0;
                for &(p, pw) in parts {
                    for r in 0..scope_rows {
                        out.data[r * w + at..r * w + at + pw]
                            .copy_from_slice(&before[p].row(r)[..pw]);
                    }
                    at += pw;
                }
            }
            VecExpr::Map { op, args, .. } => {
                let a: Vec<&Block> = args.iter().map(|&x| &before[x]).collect();
                map_blocks(op, &a, scope_rows, w, out)?;
            }
            VecExpr::SumChildren(src) => segment_sum(&before[*src], &self.edges.offsets, out),
            VecExpr::Parent(src) => expand(&before[*src], &self.edges.parent, out),
            _ => return Err(err("an input vector computed as a derived one")),
        }
        Ok(())
    }
}

/// Runs `op` over the operand blocks `args` into `out`: `rows × width`,
/// or one broadcast row when every operand is broadcast.
fn map_blocks(op: &Op, args: &[&Block], rows: usize, width: usize, out: &mut Block) -> Result<()> {
    let all_broadcast = args.iter().all(|b| b.broadcast);
    let n = if all_broadcast { 1 } else { rows };
    let mut data = std::mem::take(&mut out.data);
    map_rows(op, &operands(args), n, width, &mut data)?;
    out.data = data;
    out.rows = n;
    out.width = width;
    out.broadcast = all_broadcast;
    Ok(())
}

impl Cell {
    /// Runs the cell for a level: writes output `o`'s row of node `r`
    /// (level-relative) through `store(o, r, row)`.
    pub(super) fn run(
        &mut self,
        params: &[Vec<f32>],
        level: &LevelInputs<'_, '_>,
        store: &mut dyn FnMut(usize, usize, &[f32]),
    ) -> Result<()> {
        let edges = LevelEdges::of(level);
        let rows = level.nodes.len();
        // stage by stage: its vectors, its scalars, then its stores into
        // the scratch block (read by later stages' vectors)
        for stage in 0..self.program.stages {
            self.run_vectors(stage, params, level, &edges)?;
            self.run_scalars(stage, params, &edges, rows)?;
            self.store_stage(stage, rows);
        }
        let mut row = Vec::new();
        for (o, lanes) in self.program.outputs.iter().enumerate() {
            for r in 0..rows {
                row.clear();
                for &s in lanes {
                    row.extend_from_slice(self.scalars[s].row(r));
                }
                store(o, r, &row);
            }
        }
        Ok(())
    }

    /// The vectors of `stage`, in order.
    fn run_vectors(
        &mut self,
        stage: usize,
        params: &[Vec<f32>],
        level: &LevelInputs<'_, '_>,
        edges: &LevelEdges,
    ) -> Result<()> {
        let reads = VectorReads {
            params,
            level,
            edges,
            program: &self.program,
            sliced_only: &self.sliced_only,
            token_table: &self.token_table,
            token_width: self.token_width,
            scratch: &self.scratch,
        };
        for (v, node) in self.program.vectors.iter().enumerate() {
            if node.stage == stage {
                let (before, rest) = self.vecs.split_at_mut(v);
                reads.vector(v, node, before, &mut rest[0])?;
            }
        }
        Ok(())
    }

    /// The scalars of `stage`, in order (a dot group's with its first member).
    fn run_scalars(
        &mut self,
        stage: usize,
        params: &[Vec<f32>],
        edges: &LevelEdges,
        rows: usize,
    ) -> Result<()> {
        for id in 0..self.program.scalars.len() {
            let s = &self.program.scalars[id];
            if s.stage != stage {
                continue;
            }
            let scope_rows = if s.scope == Scope::Edge {
                edges.len()
            } else {
                rows
            };
            match self.group_of[id] {
                Some(g) if self.groups[g].members[0] == id => self.run_group(g, scope_rows)?,
                Some(_) => {} // computed with the group's first member
                None => self.run_scalar(id, params, edges, scope_rows)?,
            }
        }
        Ok(())
    }

    /// Dot group `g` as one packed GEMM over its input's rows, split among
    /// its members.
    fn run_group(&mut self, g: usize, m: usize) -> Result<()> {
        let u = self.program.units;
        let group = &self.groups[g];
        let input = &self.vecs[group.input];
        if input.broadcast {
            return Err(err("a dot product of a constant vector"));
        }
        let (n, k) = (group.packed.n, input.width);
        self.product.resize(m * n, 0.0);
        for (r0, chunk) in (0..m)
            .step_by(PACKED_MAX_M)
            .zip(self.product.chunks_mut(PACKED_MAX_M * n))
        {
            let rows = (m - r0).min(PACKED_MAX_M);
            gemm_packed(
                &input.data[r0 * k..(r0 + rows) * k],
                rows,
                &group.packed,
                &mut chunk[..rows * n],
            );
        }
        for (q, &member) in group.members.iter().enumerate() {
            let out = &mut self.scalars[member];
            out.reset(m, u);
            for r in 0..m {
                out.data[r * u..(r + 1) * u]
                    .copy_from_slice(&self.product[r * n + q * u..r * n + (q + 1) * u]);
            }
        }
        Ok(())
    }

    /// Scalar `id` (outside any dot group) over `scope_rows` rows.
    fn run_scalar(
        &mut self,
        id: usize,
        params: &[Vec<f32>],
        edges: &LevelEdges,
        scope_rows: usize,
    ) -> Result<()> {
        let u = self.program.units;
        let s = &self.program.scalars[id];
        let (before, rest) = self.scalars.split_at_mut(id);
        let out = &mut rest[0];
        match &s.expr {
            ScalarExpr::Dot { .. } => return Err(err("a dot product outside its group")),
            ScalarExpr::Read { src, col } => {
                let v = &self.vecs[*src];
                if v.broadcast {
                    out.set_broadcast(&v.data[*col..*col + u]);
                } else {
                    out.reset(v.rows, u);
                    for r in 0..v.rows {
                        out.data[r * u..(r + 1) * u].copy_from_slice(&v.row(r)[*col..*col + u]);
                    }
                }
            }
            ScalarExpr::Param { param, col } => out.set_broadcast(&params[*param][*col..*col + u]),
            &ScalarExpr::RowDot {
                matrix,
                row,
                vector,
                k,
            } => {
                let (mat, x) = (&self.vecs[matrix], &self.vecs[vector]);
                if mat.width < (row + u) * k || x.width < k {
                    return Err(err("a row product beyond its operands"));
                }
                out.reset(scope_rows, u);
                for r in 0..scope_rows {
                    let (mr, xr) = (mat.row(r), &x.row(r)[..k]);
                    for j in 0..u {
                        let m = &mr[(row + j) * k..(row + j + 1) * k];
                        out.data[r * u + j] = m.iter().zip(xr).map(|(a, b)| a * b).sum::<f32>();
                    }
                }
            }
            ScalarExpr::ColumnDot { .. } => {
                column_dot(&s.expr, params, &self.vecs, u, scope_rows, out)?
            }
            ScalarExpr::Map { op, args, .. } => {
                // vertex operands of an edge op are repeated per edge
                let expanded: Vec<Option<Block>> = args
                    .iter()
                    .map(|&a| {
                        let b = &before[a];
                        let repeat = s.scope == Scope::Edge
                            && self.program.scalars[a].scope == Scope::Vertex
                            && !b.broadcast;
                        repeat.then(|| {
                            let mut e = Block::default();
                            expand(b, &edges.parent, &mut e);
                            e
                        })
                    })
                    .collect();
                let a: Vec<&Block> = args
                    .iter()
                    .zip(&expanded)
                    .map(|(&i, e)| e.as_ref().unwrap_or(&before[i]))
                    .collect();
                map_blocks(op, &a, scope_rows, u, out)?;
            }
            ScalarExpr::ChildSum(src) => segment_sum(&before[*src], &edges.offsets, out),
        }
        Ok(())
    }

    /// Copies `stage`'s stored scalars into the scratch block (cleared at
    /// stage 0), where later stages' vectors read them.
    fn store_stage(&mut self, stage: usize, rows: usize) {
        let (sw, u) = (self.program.scratch_width, self.program.units);
        if stage == 0 {
            self.scratch.clear();
            self.scratch.resize(rows * sw, 0.0);
        }
        for &(sc, col) in &self.program.stores[stage] {
            let b = &self.scalars[sc];
            for r in 0..rows {
                self.scratch[r * sw + col..r * sw + col + u].copy_from_slice(b.row(r));
            }
        }
    }
}

/// A column product (`ScalarExpr::ColumnDot`): each unit lane sums `k`
/// weights times input columns.
fn column_dot(
    expr: &ScalarExpr,
    params: &[Vec<f32>],
    vecs: &[Block],
    u: usize,
    scope_rows: usize,
    out: &mut Block,
) -> Result<()> {
    let &ScalarExpr::ColumnDot {
        weight,
        base,
        step,
        input,
        offset,
        stride,
        k,
    } = expr
    else {
        return Err(err("not a column product"));
    };
    let (w, x) = (&params[weight], &vecs[input]);
    let last = k.saturating_sub(1);
    if k == 0 || base + last * step >= w.len() || last * stride + offset + u > x.width {
        return Err(err("a column product beyond its operands"));
    }
    out.reset_zeroed(scope_rows, u);
    // compiled for the run-time kernel level (AVX2/FMA or portable)
    ramus_core::simd!(for r in 0..scope_rows {
        let xr = x.row(r);
        let acc = &mut out.data[r * u..(r + 1) * u];
        for t in 0..k {
            let wt = w[base + t * step];
            let col = &xr[t * stride + offset..t * stride + offset + u];
            for (a, c) in acc.iter_mut().zip(col) {
                *a += wt * c;
            }
        }
    });
    Ok(())
}

/// Tokens a table build runs the cell on at once.
pub(super) const TABLE_CHUNK: usize = 512;

/// Runs `cell` once per token below `vocab` (a vertex with that token and
/// no children): one table per output, a row per token; and the median
/// seconds of a chunk of [`TABLE_CHUNK`] tokens.
pub(super) fn tabulate(
    cell: &mut Cell,
    params: &[Vec<f32>],
    vocab: usize,
) -> Result<(Vec<Vec<f32>>, f64)> {
    let widths: Vec<usize> = (0..cell.program.outputs.len())
        .map(|o| cell.program.output_width(o))
        .collect();
    let mut tables: Vec<Vec<f32>> = widths.iter().map(|&w| vec![0.0; vocab * w]).collect();
    let empty = LinearBatch::default();
    let no_rows = |_: u32| -> &[f32] { &[] };
    let mut chunks = Vec::new();
    for start in (0..vocab).step_by(TABLE_CHUNK) {
        let end = (start + TABLE_CHUNK).min(vocab);
        let tok = move |r: usize| (start + r) as u32;
        let level = LevelInputs {
            nodes: Nodes::Range(start, end),
            batch: &empty,
            child_row: &no_rows,
            head_input: None,
            token_of: Some(&tok),
        };
        let started = std::time::Instant::now();
        cell.run(params, &level, &mut |o, r, row| {
            let (t, w) = (start + r, widths[o]);
            tables[o][t * w..(t + 1) * w].copy_from_slice(row);
        })?;
        chunks.push(started.elapsed().as_secs_f64());
    }
    chunks.sort_by(f64::total_cmp);
    Ok((tables, chunks.get(chunks.len() / 2).copied().unwrap_or(0.0)))
}
