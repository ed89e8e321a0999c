//! [`CellWriter`]: the CUDA C++ of one lowered cell (its dot products, vector
//! columns and scalar arithmetic) for the node in scope, shared by the level,
//! table and unrolled kernels.

use std::fmt::Write as _;

use ramus_core::error::Result;
use ramus_core::lower::{scalar_deps, ChildRef, ScalarExpr, ScalarId, Scope, VecExpr, VecId};
use ramus_core::op::OpDef;

use super::spec::{chunks, gen_error, LoweredCell};
use ramus_core::fusion::instantiate;

/// Emits the code of one cell for the node in scope.
///
/// Names in scope where the code runs: `n` (the node), `j` (the unit),
/// `lane`, `cb`/`ce` (its child edges) and `c0`/`c1` (its first two child
/// codes, for `CHILD(e)`), `ROW(code)` (a child's state row), `tok` (its
/// token), `hin` (the head input row, head cells only), `scratch`,
/// `token_table`, `P<p>` (parameter pointers) and, for persistent weights,
/// `w<q>[i]`.
pub(crate) struct CellWriter<'a> {
    cell: LoweredCell<'a>,
    /// Weight rows held in registers: index `q` of `(weight, row)`.
    registers: Option<Vec<(usize, usize)>>,
    code: String,
    temps: usize,
    emitted_dots: Vec<bool>,
    /// Per scalar of the stage being written that only an output reads:
    /// its destination row (a pointer expression) and column (`m · U`).
    direct: Vec<Option<(String, usize)>>,
    /// Scalars whose output store was emitted with their code.
    stored: Vec<bool>,
    /// The warps of a block, when they are consecutive units of one node
    /// (every warp of the block runs the cell for the same node at the
    /// same time), so the cell may use block barriers and shared memory.
    block_warps: Option<usize>,
    /// Code to run once before the level loop (persistent weights other
    /// than the dot rows: the block-cooperative column products' slices
    /// of their static matrix), declaring what the cell code reads.
    preload: String,
}

impl<'a> CellWriter<'a> {
    pub(crate) fn new(cell: LoweredCell<'a>, registers: Option<Vec<(usize, usize)>>) -> Self {
        CellWriter {
            cell,
            registers,
            code: String::new(),
            temps: 0,
            emitted_dots: vec![false; cell.program.scalars.len()],
            direct: vec![None; cell.program.scalars.len()],
            stored: vec![false; cell.program.scalars.len()],
            block_warps: None,
            preload: String::new(),
        }
    }

    /// Marks the cell as run by whole blocks of `warps` consecutive units
    /// of one node (see [`CellWriter::block_warps`]).
    pub(crate) fn block_uniform(mut self, warps: usize) -> Self {
        self.block_warps = Some(warps);
        self
    }

    fn temp(&mut self, prefix: &str) -> String {
        self.temps += 1;
        format!("{prefix}{}", self.temps)
    }

    fn template(&self, node: usize, operands: &[String]) -> Result<String> {
        let op = self.cell.graph.nodes[node]
            .op()
            .ok_or_else(|| gen_error(format!("node %{node} is not an op")))?;
        let t = op
            .elementwise_template()
            .ok_or_else(|| gen_error(format!("node %{node} has no elementwise template")))?;
        instantiate(&t, operands).map_err(|e| gen_error(format!("node %{node}: {e}")))
    }

    /// Column `col` (a C expression) of vector `v`; `edge_row` names the
    /// current edge's child row in edge scope. Loops it needs are appended
    /// to `pre` (to run before the expression).
    fn vec_at(
        &mut self,
        v: VecId,
        col: &str,
        edge_row: Option<&str>,
        pre: &mut String,
    ) -> Result<String> {
        let node = &self.cell.program.vectors[v];
        Ok(match &node.expr {
            VecExpr::ChildState(ChildRef::Index(k)) => {
                format!("(kid{k} ? kid{k}[{col}] : 0.0f)")
            }
            VecExpr::ChildState(ChildRef::Edge) => {
                let r =
                    edge_row.ok_or_else(|| gen_error("a child edge read outside an edge loop"))?;
                format!("{r}[{col}]")
            }
            VecExpr::Embedding { table } => {
                format!(
                    "P{table}[(unsigned long long)tok * {}u + ({col})]",
                    node.width
                )
            }
            VecExpr::EmbeddingUnk { table, rows } => {
                format!(
                    "P{table}[(unsigned long long)(tok < {rows}u ? tok : 0u) * {}u + ({col})]",
                    node.width
                )
            }
            VecExpr::HeadInput => format!("hin[{col}]"),
            VecExpr::One => "1.0f".into(),
            VecExpr::Staged { slot } => format!(
                "scratch[(unsigned long long)n * {}u + {slot}u + ({col})]",
                self.cell.program.scratch_width
            ),
            VecExpr::TokenTable => format!(
                "token_table[(unsigned long long)tok * {}u + ({col})]",
                node.width
            ),
            VecExpr::Param(p) => format!("P{p}[{col}]"),
            VecExpr::Slice { src, offset } => {
                let src = *src;
                let shifted = format!("({col}) + {offset}u");
                self.vec_at(src, &shifted, edge_row, pre)?
            }
            VecExpr::Concat { parts } => {
                let parts = parts.clone();
                let mut start = 0usize;
                let mut pieces = Vec::new();
                for (p, w) in parts {
                    let local = format!("({col}) - {start}u");
                    let e = self.vec_at(p, &local, edge_row, pre)?;
                    pieces.push((start + w, e));
                    start += w;
                }
                let mut expr = pieces.last().map(|(_, e)| e.clone()).unwrap_or_default();
                for (end, e) in pieces.iter().rev().skip(1) {
                    expr = format!("(({col}) < {end}u ? {e} : {expr})");
                }
                expr
            }
            VecExpr::Map { node, args, .. } => {
                let (node, args) = (*node, args.clone());
                let mut operands = Vec::with_capacity(args.len());
                for a in args {
                    operands.push(self.vec_at(a, col, edge_row, pre)?);
                }
                self.template(node, &operands)?
            }
            VecExpr::SumChildren(src) => {
                let src = *src;
                let (acc, e, r) = (self.temp("v"), self.temp("e"), self.temp("er"));
                let mut body = String::new();
                let x = self.vec_at(src, col, Some(&r), &mut body)?;
                let _ = writeln!(
                    pre,
                    "float {acc} = 0.0f;\n#pragma unroll 2\nfor (unsigned int {e} = cb; {e} < ce; ++{e}) {{\nconst float* {r} = ROW(CHILD({e}));\n{body}{acc} += {x};\n}}",
                );
                acc
            }
            VecExpr::Parent(src) => {
                let src = *src;
                self.vec_at(src, col, None, pre)?
            }
        })
    }

    /// Declares `float a<N>[chunks]` holding, for lane `lane`, columns
    /// `shift + lane + 32·i` (`i < chunks`, columns `lane + 32·i < limit`;
    /// zero beyond) of vector `v`, appending the code to `out`; returns
    /// the array's name. Loads of all chunks are independent (unrolled),
    /// and a child sum loops over the children once, outside the chunks.
    fn vec_lanes(
        &mut self,
        v: VecId,
        shift: usize,
        chunks: usize,
        limit: usize,
        edge_row: Option<&str>,
        out: &mut String,
    ) -> Result<String> {
        let node = &self.cell.program.vectors[v];
        let a = self.temp("a");
        let each = |body: &str| {
            format!(
                "float {a}[{chunks}];\n#pragma unroll\nfor (unsigned int i = 0; i < {chunks}u; ++i) {{\nconst unsigned int t = lane + 32u * i;\n{a}[i] = t < {limit}u ? {body} : 0.0f;\n}}\n"
            )
        };
        match &node.expr {
            VecExpr::Slice { src, offset } => {
                let (src, offset) = (*src, *offset);
                return self.vec_lanes(src, shift + offset, chunks, limit, edge_row, out);
            }
            VecExpr::Map { node, args, .. } => {
                let (node, args) = (*node, args.clone());
                let mut names = Vec::with_capacity(args.len());
                for x in args {
                    names.push(self.vec_lanes(x, shift, chunks, limit, edge_row, out)?);
                }
                let operands: Vec<String> = names.iter().map(|n| format!("{n}[i]")).collect();
                let body = self.template(node, &operands)?;
                out.push_str(&each(&body));
            }
            VecExpr::SumChildren(src) => {
                let src = *src;
                let (e, r) = (self.temp("e"), self.temp("er"));
                let mut body = String::new();
                let x = self.vec_lanes(src, shift, chunks, limit, Some(&r), &mut body)?;
                let _ = writeln!(
                    out,
                    "float {a}[{chunks}];\n#pragma unroll\nfor (unsigned int i = 0; i < {chunks}u; ++i) {a}[i] = 0.0f;\n#pragma unroll 2\nfor (unsigned int {e} = cb; {e} < ce; ++{e}) {{\nconst float* {r} = ROW(CHILD({e}));\n{body}#pragma unroll\nfor (unsigned int i = 0; i < {chunks}u; ++i) {a}[i] += {x}[i];\n}}",
                );
            }
            _ => {
                // one column per chunk, straight from the per-column form
                let mut pre = String::new();
                let col = format!("t + {shift}u");
                let body = self.vec_at(v, &col, edge_row, &mut pre)?;
                if !pre.is_empty() {
                    return Err(gen_error("a per-column read needs a loop"));
                }
                out.push_str(&each(&body));
            }
        }
        Ok(a)
    }

    /// The weight of dot `(weight, row)` at chunk `i` / column `t`.
    fn weight_at(&self, weight: usize, row: usize, k: usize) -> String {
        if let Some(q) = self
            .registers
            .as_ref()
            .and_then(|rows| rows.iter().position(|&r| r == (weight, row)))
        {
            return format!("w{q}[i]");
        }
        let load = format!("P{weight}[(unsigned long long)({row}u + j) * {k}u + t]");
        if k.is_multiple_of(32) {
            load
        } else {
            // the last chunk's lanes past the row must not read the next row (or past the buffer)
            format!("(t < {k}u ? {load} : 0.0f)")
        }
    }

    /// Emits every dot product of `scope` over `input` not yet emitted
    /// (in edge scope: those in `allowed`), as one pass over the input.
    fn emit_dots(
        &mut self,
        input: VecId,
        scope: Scope,
        allowed: Option<&[bool]>,
        edge_row: Option<&str>,
    ) -> Result<()> {
        let prog = self.cell.program;
        let mut dots = Vec::new();
        let mut k = 0;
        for (id, s) in prog.scalars.iter().enumerate() {
            if let ScalarExpr::Dot {
                weight,
                row,
                input: x,
                k: kk,
            } = s.expr
            {
                let wanted = allowed.is_none_or(|a| a[id]);
                if x == input && s.scope == scope && wanted && !self.emitted_dots[id] {
                    dots.push((id, weight, row));
                    k = kk;
                }
            }
        }
        if dots.is_empty() {
            return Ok(());
        }
        let ch = chunks(k);
        let mut s = String::new();
        // the lane's columns of the input, every load issued before any use
        let x = self.vec_lanes(input, 0, ch, k, edge_row, &mut s)?;
        for &(id, ..) in &dots {
            let _ = writeln!(s, "float s{id} = 0.0f;");
        }
        let _ = writeln!(
            s,
            "#pragma unroll\nfor (unsigned int i = 0; i < {ch}u; ++i) {{\nconst unsigned int t = lane + 32u * i; (void)t;"
        );
        for &(id, weight, row) in &dots {
            let _ = writeln!(s, "s{id} += {} * {x}[i];", self.weight_at(weight, row, k));
        }
        s += "}\n";
        for &(id, ..) in &dots {
            let _ = writeln!(s, "s{id} = warp_sum(s{id});");
            self.emitted_dots[id] = true;
        }
        self.code += &s;
        Ok(())
    }

    /// Emits row product `id` ([`ScalarExpr::RowDot`]): the lanes split the
    /// row's columns, the vector's loaded once into registers.
    fn emit_row_dot(&mut self, id: ScalarId, edge_row: Option<&str>) -> Result<()> {
        let ScalarExpr::RowDot {
            matrix,
            row,
            vector,
            k,
        } = self.cell.program.scalars[id].expr
        else {
            return Err(gen_error(format!("scalar {id} is not a row product")));
        };
        let ch = chunks(k);
        let mut s = String::new();
        let x = self.vec_lanes(vector, 0, ch, k, edge_row, &mut s)?;
        let mut pre = String::new();
        let m = self.vec_at(
            matrix,
            &format!("({row}u + j) * {k}u + t"),
            edge_row,
            &mut pre,
        )?;
        if !pre.is_empty() {
            return Err(gen_error("a per-row matrix read needs a loop"));
        }
        let _ = writeln!(
            s,
            "float s{id} = 0.0f;\n#pragma unroll\nfor (unsigned int i = 0; i < {ch}u; ++i) {{\nconst unsigned int t = lane + 32u * i;\nif (t < {k}u) s{id} += {m} * {x}[i];\n}}\ns{id} = warp_sum(s{id});"
        );
        self.code += &s;
        Ok(())
    }

    /// Emits every column product ([`ScalarExpr::ColumnDot`]) of `scope`
    /// reading the same column of the same per-row matrix as `id` (not yet
    /// emitted; in edge scope those in `allowed`) as one pass: the lanes
    /// split the column's rows, loaded once into registers, and every
    /// product reads its static row from the (cached, shared by all units)
    /// parameter.
    fn emit_column_dots(
        &mut self,
        id: ScalarId,
        allowed: Option<&[bool]>,
        edge_row: Option<&str>,
    ) -> Result<()> {
        let prog = self.cell.program;
        let key = |e: &ScalarExpr| match *e {
            ScalarExpr::ColumnDot {
                input,
                offset,
                stride,
                k,
                ..
            } => Some((input, offset, stride, k)),
            _ => None,
        };
        let Some((input, offset, stride, k)) = key(&prog.scalars[id].expr) else {
            return Err(gen_error(format!("scalar {id} is not a column product")));
        };
        let scope = prog.scalars[id].scope;
        let members: Vec<ScalarId> = (0..prog.scalars.len())
            .filter(|&m| {
                key(&prog.scalars[m].expr) == Some((input, offset, stride, k))
                    && prog.scalars[m].scope == scope
                    && allowed.is_none_or(|a| a[m])
                    && !self.emitted_dots[m]
            })
            .collect();
        if members.is_empty() {
            return Ok(());
        }
        // products only an output reads, with evenly spaced rows and
        // destination columns: the lanes split the products instead
        let direct: Vec<ScalarId> = members
            .iter()
            .copied()
            .filter(|&m| self.direct[m].is_some())
            .collect();
        let members = match self.lane_parallel_column_dots(&direct, edge_row)? {
            true => members
                .into_iter()
                .filter(|m| !direct.contains(m))
                .collect(),
            false => members,
        };
        if members.is_empty() {
            return Ok(());
        }
        let ch = chunks(k);
        let x = self.temp("a");
        let mut pre = String::new();
        let col = self.vec_at(
            input,
            &format!("t * {stride}u + {offset}u + j"),
            edge_row,
            &mut pre,
        )?;
        if !pre.is_empty() {
            return Err(gen_error("a per-row matrix read needs a loop"));
        }
        let mut s = format!(
            "float {x}[{ch}];\n#pragma unroll\nfor (unsigned int i = 0; i < {ch}u; ++i) {{\nconst unsigned int t = lane + 32u * i;\n{x}[i] = t < {k}u ? {col} : 0.0f;\n}}\n"
        );
        for &m in &members {
            let _ = writeln!(s, "float s{m} = 0.0f;");
        }
        let _ = writeln!(
            s,
            "#pragma unroll\nfor (unsigned int i = 0; i < {ch}u; ++i) {{\nconst unsigned int t = lane + 32u * i;\nif (t < {k}u) {{"
        );
        for &m in &members {
            if let ScalarExpr::ColumnDot {
                weight, base, step, ..
            } = prog.scalars[m].expr
            {
                let _ = writeln!(s, "s{m} += P{weight}[{base}u + t * {step}u] * {x}[i];");
            }
        }
        s += "}\n}\n";
        for &m in &members {
            let _ = writeln!(s, "s{m} = warp_sum(s{m});");
            self.emitted_dots[m] = true;
        }
        self.code += &s;
        Ok(())
    }

    /// Emits column products `members` (of one column of one per-row
    /// matrix, each read only by an output) lane-parallel: lane `l` computes
    /// products `l, l + 32, …` over the whole column (each lane reading its
    /// own, adjacent, parameter elements; the column's values are the same
    /// for every lane: loaded once, spread over the lanes, and broadcast by
    /// shuffles, so the loop waits on no load) and stores them itself. Needs evenly spaced
    /// parameter rows and destination columns and one destination row;
    /// returns false (emitting nothing) otherwise.
    fn lane_parallel_column_dots(
        &mut self,
        members: &[ScalarId],
        edge_row: Option<&str>,
    ) -> Result<bool> {
        let prog = self.cell.program;
        let parts: Vec<(usize, usize, usize, String, usize)> = members
            .iter()
            .filter_map(|&m| match (&prog.scalars[m].expr, &self.direct[m]) {
                (
                    &ScalarExpr::ColumnDot {
                        weight, base, step, ..
                    },
                    Some((dst, col)),
                ) => Some((weight, base, step, dst.clone(), *col)),
                _ => None,
            })
            .collect();
        if parts.len() < 2 || parts.len() != members.len() {
            return Ok(false);
        }
        let (weight, base0, step, dst, col0) = parts[0].clone();
        let (db, dcol) = (
            parts[1].1.wrapping_sub(base0),
            parts[1].4.wrapping_sub(col0),
        );
        let even = parts.iter().enumerate().all(|(q, p)| {
            p.0 == weight
                && p.2 == step
                && p.3 == dst
                && p.1 == base0.wrapping_add(q.wrapping_mul(db))
                && p.4 == col0.wrapping_add(q.wrapping_mul(dcol))
        });
        if !even || db > u32::MAX as usize || dcol > u32::MAX as usize {
            return Ok(false);
        }
        let ScalarExpr::ColumnDot {
            input,
            offset,
            stride,
            k,
            ..
        } = prog.scalars[members[0]].expr
        else {
            return Ok(false);
        };
        let mut pre = String::new();
        let x = self.vec_at(
            input,
            &format!("t * {stride}u + {offset}u + j"),
            edge_row,
            &mut pre,
        )?;
        if !pre.is_empty() {
            return Ok(false);
        }
        let count = parts.len();
        if let Some(warps) = self.block_warps {
            let threads = 32 * warps;
            if count.is_multiple_of(32) && threads.is_multiple_of(count) {
                let split = threads / count;
                if self.registers.is_some() && split.is_power_of_two() && warps.is_multiple_of(4) {
                    self.register_column_dots(members, &parts[0], (db, dcol), (k, &x), warps);
                } else {
                    self.block_column_dots(members, &parts[0], (db, dcol), (k, &x), warps);
                }
                return Ok(true);
            }
        }
        let (ch, ck) = (chunks(count), chunks(k));
        let (acc, xs) = (self.temp("acc"), self.temp("xs"));
        let _ = writeln!(
            self.code,
            "// {count} column products, lane-parallel (the column loaded once, lane `l` holding elements `l, l + 32, …`, then broadcast)\n{{\nfloat {acc}[{ch}];\n#pragma unroll\nfor (unsigned int cq = 0; cq < {ch}u; ++cq) {acc}[cq] = 0.0f;\nfloat {xs}[{ck}];\n#pragma unroll\nfor (unsigned int i = 0; i < {ck}u; ++i) {{\nconst unsigned int t = lane + 32u * i;\n{xs}[i] = t < {k}u ? {x} : 0.0f;\n}}\n#pragma unroll\nfor (unsigned int i = 0; i < {ck}u; ++i) {{\n#pragma unroll 8\nfor (unsigned int src = 0; src < 32u; ++src) {{\nconst unsigned int t = 32u * i + src;\nif (t < {k}u) {{\nconst float xv = __shfl_sync(0xffffffffu, {xs}[i], src);\n#pragma unroll\nfor (unsigned int cq = 0; cq < {ch}u; ++cq) {{\nconst unsigned int q = lane + 32u * cq;\nif (q < {count}u) {acc}[cq] += P{weight}[{base0}u + q * {db}u + t * {step}u] * xv;\n}}\n}}\n}}\n}}\n#pragma unroll\nfor (unsigned int cq = 0; cq < {ch}u; ++cq) {{\nconst unsigned int q = lane + 32u * cq;\nif (q < {count}u) ({dst})[{col0}u + q * {dcol}u + j] = {acc}[cq];\n}}\n}}"
        );
        self.mark_stored(members);
        Ok(true)
    }

    /// Marks products `members` as emitted and stored by their own code.
    fn mark_stored(&mut self, members: &[ScalarId]) {
        for &m in members {
            self.emitted_dots[m] = true;
            self.stored[m] = true;
        }
    }

    /// Emits lane-parallel column products `members` (see
    /// [`CellWriter::lane_parallel_column_dots`]) for a whole block of
    /// `warps` consecutive units at once: each warp puts its own column of
    /// the input into shared memory, then every thread computes one row of
    /// the products for `count / 32` of the block's columns, so each
    /// parameter element read serves that many products (register
    /// blocking) instead of one per warp.
    fn block_column_dots(
        &mut self,
        members: &[ScalarId],
        first: &(usize, usize, usize, String, usize),
        (db, dcol): (usize, usize),
        (k, x): (usize, &str),
        warps: usize,
    ) {
        let (weight, base0, step, dst, col0) = first;
        let count = members.len();
        let threads = 32 * warps;
        // threads per column group: `groups` groups of `count` rows
        let groups = threads / count;
        let per = warps / groups;
        let (xsh, acc) = (self.temp("xsh"), self.temp("acc"));
        let ck = chunks(k);
        let _ = writeln!(
            self.code,
            "// {count} column products of the block's {warps} units, block-cooperative\n{{\n__shared__ float {xsh}[{k} * {warps}];\nconst unsigned int wib = threadIdx.x >> 5;\n#pragma unroll\nfor (unsigned int i = 0; i < {ck}u; ++i) {{\nconst unsigned int t = lane + 32u * i;\nif (t < {k}u) {xsh}[t * {warps}u + wib] = {x};\n}}\n__syncthreads();\nconst unsigned int q = threadIdx.x % {count}u, g = threadIdx.x / {count}u;\nfloat {acc}[{per}];\n#pragma unroll\nfor (unsigned int m = 0; m < {per}u; ++m) {acc}[m] = 0.0f;\n#pragma unroll 4\nfor (unsigned int t = 0; t < {k}u; ++t) {{\nconst float w = P{weight}[{base0}u + q * {db}u + t * {step}u];\n#pragma unroll\nfor (unsigned int m = 0; m < {per}u; ++m) {acc}[m] += w * {xsh}[t * {warps}u + g + {groups}u * m];\n}}\n__syncthreads();\n#pragma unroll\nfor (unsigned int m = 0; m < {per}u; ++m) ({dst})[{col0}u + q * {dcol}u + (j - wib) + g + {groups}u * m] = {acc}[m];\n}}"
        );
        self.mark_stored(members);
    }

    /// The block-cooperative column products (see
    /// [`CellWriter::block_column_dots`]) with the static matrix held in
    /// registers across levels (model persistence): the block's threads
    /// split the `count` rows and, `split = threads / count` ways, the `k`
    /// columns of the matrix (thread `q · split + g` holds row `q`'s
    /// columns `g, g + split, …`, loaded once by [`CellWriter::preload`]).
    /// Each thread multiplies its slice into every one of the block's
    /// input columns (read from shared memory, four at a time) and the
    /// `split` partial sums of a row, in adjacent lanes, are added by
    /// shuffles; the row's first thread stores the block's columns.
    fn register_column_dots(
        &mut self,
        members: &[ScalarId],
        first: &(usize, usize, usize, String, usize),
        (db, dcol): (usize, usize),
        (k, x): (usize, &str),
        warps: usize,
    ) {
        let (weight, base0, step, dst, col0) = first;
        let count = members.len();
        let split = 32 * warps / count;
        let per_thread = k.div_ceil(split);
        // a padded row of the shared input (the split threads of a row read
        // rows t, t + 1, … at once: four floats apart in the banks)
        let stride = warps + 4;
        let (xsh, acc, held) = (
            self.temp("xsh"),
            self.temp("acc"),
            format!("cw{}", members[0]),
        );
        let _ = writeln!(
            self.preload,
            "// the block's slice of P{weight} for its {count} column products: row threadIdx.x / {split}, columns threadIdx.x % {split} + {split} * i\nfloat {held}[{per_thread}];\n#pragma unroll\nfor (u32 i = 0; i < {per_thread}u; ++i) {{ const u32 t = (threadIdx.x % {split}u) + {split}u * i; {held}[i] = t < {k}u ? P{weight}[{base0}u + (threadIdx.x / {split}u) * {db}u + t * {step}u] : 0.0f; }}"
        );
        let ck = chunks(k);
        let rows = per_thread * split;
        let _ = writeln!(
            self.code,
            "// {count} column products of the block's {warps} units, block-cooperative, the matrix in registers\n{{\n__shared__ __align__(16) float {xsh}[{rows} * {stride}];\nconst unsigned int wib = threadIdx.x >> 5;\n#pragma unroll\nfor (unsigned int i = 0; i < {ck}u; ++i) {{\nconst unsigned int t = lane + 32u * i;\nif (t < {k}u) {xsh}[t * {stride}u + wib] = {x};\n}}\nif (threadIdx.x < {pad}u) {xsh}[({k}u + threadIdx.x / {warps}u) * {stride}u + threadIdx.x % {warps}u] = 0.0f;\n__syncthreads();\nconst unsigned int q = threadIdx.x / {split}u, g = threadIdx.x % {split}u;\nfloat {acc}[{warps}];\n#pragma unroll\nfor (unsigned int c = 0; c < {warps}u; ++c) {acc}[c] = 0.0f;\n#pragma unroll\nfor (unsigned int i = 0; i < {per_thread}u; ++i) {{\nconst float w = {held}[i];\nconst float4* xr = reinterpret_cast<const float4*>({xsh} + ({split}u * i + g) * {stride}u);\n#pragma unroll\nfor (unsigned int c = 0; c < {quads}u; ++c) {{\nconst float4 xv = xr[c];\n{acc}[4u * c] += w * xv.x; {acc}[4u * c + 1u] += w * xv.y; {acc}[4u * c + 2u] += w * xv.z; {acc}[4u * c + 3u] += w * xv.w;\n}}\n}}\n#pragma unroll\nfor (unsigned int c = 0; c < {warps}u; ++c) {{\n#pragma unroll\nfor (unsigned int o = {half}u; o > 0u; o >>= 1) {acc}[c] += __shfl_xor_sync(0xffffffffu, {acc}[c], o);\n}}\n__syncthreads();\nif (g == 0u) {{\n#pragma unroll\nfor (unsigned int c = 0; c < {warps}u; ++c) ({dst})[{col0}u + q * {dcol}u + (j - wib) + c] = {acc}[c];\n}}\n}}",
            pad = (rows - k) * warps,
            quads = warps / 4,
            half = split / 2,
        );
        self.mark_stored(members);
    }

    /// Emits scalar `id` (its dots, loops and arithmetic); `edge_row`
    /// and `allowed` are set inside a child loop.
    fn emit_scalar(
        &mut self,
        id: ScalarId,
        edge_row: Option<&str>,
        allowed: Option<&[bool]>,
    ) -> Result<()> {
        let prog = self.cell.program;
        let s = &prog.scalars[id];
        let line = match &s.expr {
            ScalarExpr::Dot { input, .. } => {
                return self.emit_dots(*input, s.scope, allowed, edge_row);
            }
            ScalarExpr::RowDot { .. } => return self.emit_row_dot(id, edge_row),
            ScalarExpr::ColumnDot { .. } => return self.emit_column_dots(id, allowed, edge_row),
            ScalarExpr::Read { src, col } => {
                let mut pre = String::new();
                let e = self.vec_at(*src, &format!("{col}u + j"), edge_row, &mut pre)?;
                format!("{pre}const float s{id} = {e};")
            }
            ScalarExpr::Param { param, col } => {
                format!("const float s{id} = P{param}[{col}u + j];")
            }
            ScalarExpr::Map { node, args, .. } => {
                let operands: Vec<String> = args.iter().map(|a| format!("s{a}")).collect();
                format!("const float s{id} = {};", self.template(*node, &operands)?)
            }
            ScalarExpr::ChildSum(src) => {
                let src = *src;
                // the edge scalars `src` needs, recomputed per edge
                let mut cone = vec![false; prog.scalars.len()];
                cone[src] = true;
                for i in (0..=src).rev() {
                    if cone[i] && prog.scalars[i].scope == Scope::Edge {
                        for d in scalar_deps(&prog.scalars[i].expr) {
                            if prog.scalars[d].scope == Scope::Edge {
                                cone[d] = true;
                            }
                        }
                    }
                }
                let (e, r) = (self.temp("e"), self.temp("er"));
                let _ = writeln!(
                    self.code,
                    "float s{id} = 0.0f;\n#pragma unroll 2\nfor (unsigned int {e} = cb; {e} < ce; ++{e}) {{\nconst float* {r} = ROW(CHILD({e}));",
                );
                let saved =
                    std::mem::replace(&mut self.emitted_dots, vec![false; prog.scalars.len()]);
                // reads first (they depend on nothing): their loads go out
                // before the dot products' shuffles
                let is_read = |i: usize| matches!(prog.scalars[i].expr, ScalarExpr::Read { .. });
                let reads_first = (0..=src)
                    .filter(|&i| cone[i] && is_read(i))
                    .chain((0..=src).filter(|&i| cone[i] && !is_read(i)));
                for i in reads_first {
                    self.emit_scalar(i, Some(&r), Some(&cone))?;
                }
                self.emitted_dots = saved;
                let _ = writeln!(self.code, "s{id} += s{src};\n}}");
                return Ok(());
            }
        };
        self.code += &line;
        self.code.push('\n');
        Ok(())
    }

    /// The cell's code, storing output `o`'s lanes through `outputs[o]`
    /// (a row pointer expression).
    pub(crate) fn cell(self, outputs: &[&str]) -> Result<String> {
        self.cell_stage(0, outputs)
    }

    /// The code of stage `stage` of the cell: its scalars, its stores into
    /// the scratch row (`scratch + n · scratch_width`) and the output lanes
    /// it computes, stored through `outputs[o]` (a row pointer expression).
    pub(crate) fn cell_stage(self, stage: usize, outputs: &[&str]) -> Result<String> {
        let (code, preload) = self.cell_stage_with_preload(stage, outputs)?;
        if !preload.is_empty() {
            return Err(gen_error(
                "a cell keeping a matrix in registers runs only in the level kernel",
            ));
        }
        Ok(code)
    }

    /// [`CellWriter::cell_stage`], and the code to run once before the
    /// level loop for it ([`CellWriter::preload`]).
    pub(crate) fn cell_stage_with_preload(
        mut self,
        stage: usize,
        outputs: &[&str],
    ) -> Result<(String, String)> {
        let prog = self.cell.program;
        // child pointers for fixed-arity reads
        let mut kids: Vec<usize> = prog
            .vectors
            .iter()
            .filter_map(|v| match v.expr {
                VecExpr::ChildState(ChildRef::Index(k)) => Some(k),
                _ => None,
            })
            .collect();
        kids.sort_unstable();
        kids.dedup();
        for k in kids {
            let _ = writeln!(
                self.code,
                "const float* kid{k} = cb + {k}u < ce ? ROW(CHILD(cb + {k}u)) : nullptr; (void)kid{k};"
            );
        }
        if outputs.len() != prog.outputs.len() {
            return Err(gen_error(format!(
                "the cell has {} outputs, {} destinations given",
                prog.outputs.len(),
                outputs.len()
            )));
        }
        // this stage's vertex scalars read by one output lane and nothing else
        let mut uses = vec![0usize; prog.scalars.len()];
        for s in &prog.scalars {
            for d in scalar_deps(&s.expr) {
                uses[d] += 1;
            }
        }
        for &(sc, _) in prog.stores.iter().flatten() {
            uses[sc] += 1;
        }
        let mut destination = vec![None; prog.scalars.len()];
        for (lanes, dst) in prog.outputs.iter().zip(outputs) {
            for (m, &s) in lanes.iter().enumerate() {
                uses[s] += 1;
                destination[s] = Some((dst.to_string(), m * prog.units));
            }
        }
        for (id, s) in prog.scalars.iter().enumerate() {
            if s.scope == Scope::Vertex && s.stage == stage && uses[id] == 1 {
                self.direct[id] = destination[id].take();
            }
        }
        for id in 0..prog.scalars.len() {
            let s = &prog.scalars[id];
            if s.scope == Scope::Vertex && s.stage == stage {
                self.emit_scalar(id, None, None)?;
            }
        }
        self.code += "if (lane == 0) {\n";
        for &(sc, col) in prog.stores.get(stage).into_iter().flatten() {
            let _ = writeln!(
                self.code,
                "scratch[(u64)n * {}u + {col}u + j] = s{sc};",
                prog.scratch_width
            );
        }
        for (lanes, dst) in prog.outputs.iter().zip(outputs) {
            for (m, &s) in lanes.iter().enumerate() {
                if prog.scalars[s].stage == stage && !self.stored[s] {
                    let _ = writeln!(self.code, "({dst})[{}u + j] = s{s};", m * prog.units);
                }
            }
        }
        self.code += "}\n";
        Ok((self.code, self.preload))
    }
}
