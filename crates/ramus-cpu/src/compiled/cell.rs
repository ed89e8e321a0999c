//! The compiled CPU engine's cell interpreter: a lowered cell run over a
//! level's rows at once ([`Cell::run`]: packed GEMMs for its dot products,
//! vectorized unit scalars, child sums over CSR edges), and the per-token
//! tables of leaf specialization ([`tabulate`]).

use ramus_core::lower::{
    scalar_vectors, vec_deps, CellProgram, ChildRef, ScalarExpr, Scope, VecExpr,
};
use ramus_core::ops::matmul::PACKED_MAX_M;
use ramus_core::ops::unk_row;
use ramus_core::Params;
use ramus_graph::LinearBatch;

use crate::cell_eval::{map_rows, MapOperand};
use crate::kernels::{gemm_packed, PackedB};

use super::err;
use ramus_exec::Result;

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

impl Cell {
    /// Runs the cell for a level: writes output `o`'s row of node `r`
    /// (level-relative) through `store(o, r, row)`.
    pub(super) fn run(
        &mut self,
        params: &[Vec<f32>],
        level: &LevelInputs<'_, '_>,
        store: &mut dyn FnMut(usize, usize, &[f32]),
    ) -> Result<()> {
        let batch = level.batch;
        let rows = level.nodes.len();
        // the level's CSR, relative
        let mut offsets = Vec::with_capacity(rows + 1);
        let mut parent = Vec::new();
        let mut edge_child = Vec::new();
        offsets.push(0u32);
        for r in 0..rows {
            let n = level.nodes.get(r);
            let kids = if level.token_of.is_some() {
                &[][..]
            } else {
                batch.children(n as u32)
            };
            for &c in kids {
                parent.push(r as u32);
                edge_child.push(c);
            }
            offsets.push(edge_child.len() as u32);
        }
        let edges = edge_child.len();
        let token = |r: usize| match level.token_of {
            Some(t) => t(r),
            None => batch.tokens()[level.nodes.get(r)],
        };
        let prog = &self.program;
        let u = prog.units;
        // stage by stage: its vectors, its scalars, then its stores into
        // the scratch block (read by later stages' vectors)
        for stage in 0..prog.stages {
            for (v, node) in prog.vectors.iter().enumerate() {
                if node.stage != stage {
                    continue;
                }
                let (before, rest) = self.vecs.split_at_mut(v);
                let out = &mut rest[0];
                let scope_rows = if node.scope == Scope::Edge {
                    edges
                } else {
                    rows
                };
                let w = node.width;
                match &node.expr {
                    VecExpr::ChildState(ChildRef::Index(k)) => {
                        out.reset_zeroed(rows, w);
                        for r in 0..rows {
                            let (a, b) = (offsets[r] as usize, offsets[r + 1] as usize);
                            if a + k < b {
                                let row = (level.child_row)(edge_child[a + k]);
                                out.data[r * w..(r + 1) * w].copy_from_slice(&row[..w]);
                            }
                        }
                    }
                    VecExpr::ChildState(_) if self.sliced_only[v] => {}
                    VecExpr::ChildState(ChildRef::Edge) => {
                        out.reset(edges, w);
                        for (e, &c) in edge_child.iter().enumerate() {
                            let row = (level.child_row)(c);
                            out.data[e * w..(e + 1) * w].copy_from_slice(&row[..w]);
                        }
                    }
                    VecExpr::Embedding { table } => {
                        out.reset(rows, w);
                        let t = &params[*table];
                        for r in 0..rows {
                            let tok = token(r) as usize;
                            let src = t.get(tok * w..(tok + 1) * w).ok_or_else(|| {
                                err(format!("token {tok} beyond the embedding table"))
                            })?;
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
                            let at = unk_row(token(r), *table_rows) * w;
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
                        let table = &self.token_table;
                        for r in 0..rows {
                            let tok = token(r) as usize;
                            let at = tok * self.token_width;
                            let src = table.get(at..at + w).ok_or_else(|| {
                                err(format!("token {tok} beyond the token table"))
                            })?;
                            out.data[r * w..(r + 1) * w].copy_from_slice(src);
                        }
                    }
                    VecExpr::HeadInput => {
                        let h = level.head_input.ok_or_else(|| err("no head input"))?;
                        out.reset(rows, w);
                        for r in 0..rows {
                            out.data[r * w..(r + 1) * w].copy_from_slice(&h(r)[..w]);
                        }
                    }
                    VecExpr::One => out.set_broadcast(&vec![1.0; w]),
                    VecExpr::Staged { slot } => {
                        let sw = prog.scratch_width;
                        out.reset(rows, w);
                        for r in 0..rows {
                            out.data[r * w..(r + 1) * w]
                                .copy_from_slice(&self.scratch[r * sw + slot..r * sw + slot + w]);
                        }
                    }
                    VecExpr::Param(p) => out.set_broadcast(&params[*p][..w]),
                    VecExpr::Slice { src, offset } if self.sliced_only[*src] => {
                        // columns offset..offset + w of the child rows
                        let off = *offset;
                        let copy = |out: &mut Block, r: usize, c: u32| {
                            let row = (level.child_row)(c);
                            out.data[r * w..(r + 1) * w].copy_from_slice(&row[off..off + w]);
                        };
                        match prog.vectors[*src].expr {
                            VecExpr::ChildState(ChildRef::Edge) => {
                                out.reset(edges, w);
                                for (e, &c) in edge_child.iter().enumerate() {
                                    copy(out, e, c);
                                }
                            }
                            VecExpr::ChildState(ChildRef::Index(k)) => {
                                out.reset_zeroed(rows, w);
                                for r in 0..rows {
                                    let (a, b) = (offsets[r] as usize, offsets[r + 1] as usize);
                                    if a + k < b {
                                        copy(out, r, edge_child[a + k]);
                                    }
                                }
                            }
                            _ => return Err(err("a direct slice of a non-child vector")),
                        }
                    }
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
                        let all_broadcast = a.iter().all(|b| b.broadcast);
                        let n = if all_broadcast { 1 } else { scope_rows };
                        let mut data = std::mem::take(&mut out.data);
                        map_rows(op, &operands(&a), n, w, &mut data)?;
                        out.data = data;
                        out.rows = n;
                        out.width = w;
                        out.broadcast = all_broadcast;
                    }
                    VecExpr::SumChildren(src) => segment_sum(&before[*src], &offsets, out),
                    VecExpr::Parent(src) => expand(&before[*src], &parent, out),
                }
            }
            for id in 0..prog.scalars.len() {
                let s = &prog.scalars[id];
                if s.stage != stage {
                    continue;
                }
                let scope_rows = if s.scope == Scope::Edge { edges } else { rows };
                if let Some(g) = self.group_of[id] {
                    let group = &self.groups[g];
                    if group.members[0] != id {
                        continue; // computed with the group's first member
                    }
                    let input = &self.vecs[group.input];
                    if input.broadcast {
                        return Err(err("a dot product of a constant vector"));
                    }
                    let (m, n, k) = (scope_rows, group.packed.n, input.width);
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
                    continue;
                }
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
                                out.data[r * u..(r + 1) * u]
                                    .copy_from_slice(&v.row(r)[*col..*col + u]);
                            }
                        }
                    }
                    ScalarExpr::Param { param, col } => {
                        out.set_broadcast(&params[*param][*col..*col + u])
                    }
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
                                out.data[r * u + j] =
                                    m.iter().zip(xr).map(|(a, b)| a * b).sum::<f32>();
                            }
                        }
                    }
                    &ScalarExpr::ColumnDot {
                        weight,
                        base,
                        step,
                        input,
                        offset,
                        stride,
                        k,
                    } => {
                        let (w, x) = (&params[weight], &self.vecs[input]);
                        let last = k.saturating_sub(1);
                        if k == 0
                            || base + last * step >= w.len()
                            || last * stride + offset + u > x.width
                        {
                            return Err(err("a column product beyond its operands"));
                        }
                        out.reset_zeroed(scope_rows, u);
                        for r in 0..scope_rows {
                            let xr = x.row(r);
                            let acc = &mut out.data[r * u..(r + 1) * u];
                            for t in 0..k {
                                let wt = w[base + t * step];
                                let col = &xr[t * stride + offset..t * stride + offset + u];
                                for (a, c) in acc.iter_mut().zip(col) {
                                    *a += wt * c;
                                }
                            }
                        }
                    }
                    ScalarExpr::Map { op, args, .. } => {
                        // vertex operands of an edge op are repeated per edge
                        let mut expanded: Vec<Block> = Vec::new();
                        let mut picks: Vec<(bool, usize)> = Vec::with_capacity(args.len());
                        for &a in args {
                            let b = &before[a];
                            if s.scope == Scope::Edge
                                && prog.scalars[a].scope == Scope::Vertex
                                && !b.broadcast
                            {
                                let mut e = Block::default();
                                expand(b, &parent, &mut e);
                                expanded.push(e);
                                picks.push((true, expanded.len() - 1));
                            } else {
                                picks.push((false, a));
                            }
                        }
                        let a: Vec<&Block> = picks
                            .iter()
                            .map(|&(exp, i)| if exp { &expanded[i] } else { &before[i] })
                            .collect();
                        let all_broadcast = a.iter().all(|b| b.broadcast);
                        let n = if all_broadcast { 1 } else { scope_rows };
                        let mut data = std::mem::take(&mut out.data);
                        map_rows(op, &operands(&a), n, u, &mut data)?;
                        out.data = data;
                        out.rows = n;
                        out.width = u;
                        out.broadcast = all_broadcast;
                    }
                    ScalarExpr::ChildSum(src) => segment_sum(&before[*src], &offsets, out),
                }
            }
            let sw = prog.scratch_width;
            if stage == 0 {
                self.scratch.clear();
                self.scratch.resize(rows * sw, 0.0);
            }
            for &(sc, col) in &prog.stores[stage] {
                let b = &self.scalars[sc];
                for r in 0..rows {
                    self.scratch[r * sw + col..r * sw + col + u].copy_from_slice(b.row(r));
                }
            }
        }
        let mut row = Vec::new();
        for (o, lanes) in prog.outputs.iter().enumerate() {
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
}

/// Runs `cell` once per token below `vocab` (a vertex with that token and
/// no children): one table per output, a row per token.
pub(super) fn tabulate(
    cell: &mut Cell,
    params: &[Vec<f32>],
    vocab: usize,
) -> Result<Vec<Vec<f32>>> {
    let widths: Vec<usize> = (0..cell.program.outputs.len())
        .map(|o| cell.program.output_width(o))
        .collect();
    let mut tables: Vec<Vec<f32>> = widths.iter().map(|&w| vec![0.0; vocab * w]).collect();
    let empty = LinearBatch::default();
    let no_rows = |_: u32| -> &[f32] { &[] };
    const CHUNK: usize = 512;
    for start in (0..vocab).step_by(CHUNK) {
        let end = (start + CHUNK).min(vocab);
        let tok = move |r: usize| (start + r) as u32;
        let level = LevelInputs {
            nodes: Nodes::Range(start, end),
            batch: &empty,
            child_row: &no_rows,
            head_input: None,
            token_of: Some(&tok),
        };
        cell.run(params, &level, &mut |o, r, row| {
            let (t, w) = (start + r, widths[o]);
            tables[o][t * w..(t + 1) * w].copy_from_slice(row);
        })?;
    }
    Ok(tables)
}
