//! CodeGen of the compiled inference engine (Cortex §5): CUDA C++ for a
//! recursive model's [`CellProgram`]s — one persistent kernel that walks
//! every level of a linearized batch, and one that tabulates the leaf cell
//! per token at model load (leaf specialization with hoisting).
//!
//! # The level kernel
//!
//! A warp owns one unit `j` of the internal cell (and a replica number: with
//! `R` warps per unit, replica `r` takes nodes `r, r + R, …` of a level). With
//! **model persistence** the warp loads its unit's weight rows into registers
//! once (lane `l` holds columns `l, l + 32, …`) and keeps them across all
//! levels; without, it reads them from global memory at each use.
//!
//! Per node the warp evaluates the **fused cell**: each dot product's lanes
//! evaluate their own columns of the input vector straight from the
//! children's state rows (a child sum is summed on the fly), multiply by
//! their weights and reduce with warp shuffles; the unit's gate arithmetic
//! follows in registers; lane 0 stores the unit's columns of the new state
//! and pushed rows. No intermediate tensor touches memory. The lanes'
//! input columns are loaded into registers first, all chunks at once (a
//! child sum loops over the children once), so a node costs a few memory
//! round trips, not one per column block. Between levels a grid-wide
//! barrier (the kernel is launched cooperatively, so all blocks are
//! resident) orders the stores before the next level's loads; the next
//! level's range is loaded before the barrier. Plain (L1-cached) loads are
//! safe for the state: a row is written once, in its level, and read only
//! after it, so no SM ever caches a stale copy.
//!
//! With **node counters** ([`TreeKernelSpec::node_counters`]) the levels
//! are ordered by data flow instead of grid barriers. Each internal node
//! has a completion counter per stage (`done`, zeroed by the host with
//! each batch's upload). A block (or a warp, when a block holds units of
//! two replicas) starts a level by waiting for the internal children of
//! the nodes it computes there, one node per thread, all polled at once
//! with relaxed loads and then one acquire fence per polling thread and a
//! block barrier; after computing them, a block barrier and one release
//! add per node. A block thus waits only for the rows it reads, never for
//! the slowest block of the grid, and a stage waits for its own nodes'
//! previous stage the same way. Deadlock-free for the same reason as the
//! barriers: every block is resident and walks the levels in order,
//! waiting only for nodes of earlier levels (or stages).
//!
//! With the **leaf table**, leaves run no code: the host encodes each
//! child as a *row code* (`child_rows`): its node number if it is internal,
//! `num_internal + token` if it is a leaf (the linearizer numbers leaves
//! last, so the kernel's leaf check is the one comparison `code <
//! num_internal`, with no further load), and a leaf's row is its token's
//! row of the table the table kernel filled at load. Without it, codes are
//! node numbers and the kernel first runs the leaf cell on every leaf, then
//! a barrier. After the last level the head cell scores every root from its
//! pushed row.
//!
//! A **multi-stage** internal cell (a product of a per-unit value, as in a
//! TreeGRU: [`CellProgram::stages`]) runs each level stage by stage: a
//! stage's warps store the values the next stage reads as vectors into the
//! node's scratch row, and a grid barrier separates the stages.
//!
//! With **hoisting** ([`CellProgram::hoist_token_values`]), the internal
//! cell's values that depend on a node's token alone (a DAG-RNN's or an
//! LSTM's input projection `W x + b`) come from a second per-token table,
//! filled by the token-table kernel at load, instead of a product per node.
//!
//! Kernel parameters (the engine's launch relies on this order):
//!
//! ```text
//! NAME_levels(const float* params, float* state, float* push,
//!             const float* table_state, const float* table_push, const float* token_table,
//!             float* scratch,
//!             const u32* child_offsets, const u32* child_rows, const u32* tokens,
//!             const u32* batch_begin, const u32* batch_length, u32 num_batches,
//!             u32 num_internal, u32 num_nodes, const u32* roots, u32 num_roots,
//!             float* scores, u32* barrier, u32* done,
//!             InlineIndices inl, u32* done_next, u32 done_clear)
//! NAME_leaf_table(const float* params, float* out_state, float* out_push, u32 vocab)
//! NAME_token_table(const float* params, float* out_table, u32 vocab)   // with hoisting
//! ```
//!
//! A batch whose index arrays fit [`INLINE_INDEX_WORDS`] words passes
//! them by value in `inl` (`inl.count > 0`; the pointers are then
//! unused): the launch carries them, with no copy to issue, and each block
//! reads them from shared memory. Every launch clears `done_clear` words
//! of `done_next`, the counters of the next launch (the engine alternates
//! two arrays), so no batch uploads zeroed counters.
//!
//! A multi-stage leaf cell (a refactored model's leaf, see
//! [`crate::recursion`]) runs stage by stage too: without the table, with
//! a grid barrier after each stage of the leaf phase (scratch rows then
//! cover every node); its table is built by one kernel per stage,
//! `NAME_leaf_table`, `NAME_leaf_table_s1`, …, each taking a scratch
//! pointer (a row per token) before `vocab`, launched in order. The
//! unrolled level kernel is generated in [`crate::cellgen_unroll`].
//!
//! `params` holds every parameter at its offset ([`TreeKernelSpec::param_offsets`],
//! compiled in as constants); `state`/`push` have a row per node
//! (`num_nodes` rows); `scores` a row per root; `barrier` two zeroed
//! words; `done` `stages · num_internal` zeroed counters (node counters
//! only; unused otherwise); `scratch` a row of the internal cell's scratch width per internal
//! node (multi-stage cells).

use std::fmt::Write as _;

use crate::error::{CoreError, Result};
use crate::fusion::instantiate;
use crate::graph::Graph;
use crate::lower::{
    scalar_deps, CellProgram, ChildRef, ScalarExpr, ScalarId, Scope, VecExpr, VecId,
};

/// Index words a level kernel launch carries by value
/// (`InlineIndices::words`; the whole parameter block stays under the
/// 4 KiB every CUDA driver accepts).
pub const INLINE_INDEX_WORDS: usize = 896;

/// Threads per block of the generated kernels by default: few, large
/// blocks keep the grid barrier cheap (1024 was slower on an H100: costlier
/// block barriers and half the registers per thread).
pub const CELL_BLOCK: u32 = 512;

/// Threads per block when the persistent weights need more than 64
/// registers per thread: a block of 256 threads may use up to 255 each,
/// where 512 threads (128 each) would spill them (a binary Tree-LSTM at
/// hidden 512, 160 weight registers: 0.07 ms a tree instead of 0.18 on an
/// H100).
pub const WIDE_CELL_BLOCK: u32 = 256;

/// A lowered function: its graph (for the ops' templates) and program.
#[derive(Clone, Copy)]
pub struct LoweredCell<'a> {
    pub graph: &'a Graph,
    pub program: &'a CellProgram,
}

/// What the level and table kernels are generated from.
#[derive(Clone, Copy)]
pub struct TreeKernelSpec<'a> {
    /// Kernel name prefix.
    pub name: &'a str,
    /// The leaf cell (outputs: state, pushed value).
    pub leaf: LoweredCell<'a>,
    /// The internal cell (outputs: state, pushed value).
    pub internal: LoweredCell<'a>,
    /// The head (output: scores).
    pub head: LoweredCell<'a>,
    /// Float offset of each parameter in the parameter buffer.
    pub param_offsets: &'a [usize],
    /// Keep the internal cell's weight rows in registers across levels.
    pub persistent_weights: bool,
    /// Read leaves from the token table instead of running the leaf cell.
    pub leaf_table: bool,
    /// Threads per block the kernels are launched with (a multiple of 32;
    /// compiled in as their launch bound).
    pub block_threads: u32,
    /// Order levels (and stages) by per-node completion counters instead
    /// of grid barriers: a block (or warp) waits only for the children of
    /// the nodes it computes, so a level starts where its children are
    /// ready (see the module docs).
    pub node_counters: bool,
    /// With hoisting, the program computing the internal cell's token
    /// table (its values that depend on the token alone; the internal
    /// program then reads them through [`VecExpr::TokenTable`]).
    pub token_table: Option<LoweredCell<'a>>,
}

fn gen_error(message: impl Into<String>) -> CoreError {
    CoreError::Kernel {
        op: "compiled-engine codegen".into(),
        message: message.into(),
    }
}

/// Columns per lane of a dot product of length `k` (lane `l` takes
/// `l, l + 32, …`).
fn chunks(k: usize) -> usize {
    k.div_ceil(32)
}

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
        let t = crate::op::OpDef::elementwise_template(op)
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
    fn cell(self, outputs: &[&str]) -> Result<String> {
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

const PRELUDE: &str = r#"typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The code of child edge e (its first two come from registers).
#define CHILD(e) ((e) == cb ? c0 : (e) == cb + 1u ? c1 : child_rows[e])

// Loads the child range and first two child codes of node begin + rep (if
// the level has it): the next level's, issued before its barrier, or a
// waiting thread's further nodes of the level.
__device__ __forceinline__ void prefetch_node(u32 begin, u32 len, u32 rep, const u32* child_offsets,
                                              const u32* child_rows, u32* cb, u32* ce, u32* c0,
                                              u32* c1) {
    if (rep < len) {
        const u32 n = begin + rep;
        *cb = child_offsets[n];
        *ce = child_offsets[n + 1];
        *c0 = *cb < *ce ? child_rows[*cb] : 0u;
        *c1 = *cb + 1u < *ce ? child_rows[*cb + 1u] : 0u;
    }
}

// Grid-wide barrier for a cooperative launch. Thread 0 of each block
// arrives on bar[0] with release semantics (cumulative over the block's
// stores, which __syncthreads ordered before it); the last to arrive
// resets the count and publishes generation *gen + 1 in bar[1] (release);
// the others wait for it with acquire loads. *gen is the block's own copy
// of the generation (read once at kernel start, before any block can
// arrive), so a barrier costs no load before arriving.
__device__ __forceinline__ u32 barrier_generation(const u32* bar) {
    u32 g;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(g) : "l"(bar + 1) : "memory");
    return g;
}

// Per-node completion counters (dataflow order): the warps (or blocks)
// of a node's units each add one with release semantics after its stores
// (lane 0 stored, or a block barrier ordered the stores before thread 0);
// a reader polls with relaxed loads until all have arrived, then an
// acquire fence orders its own later loads of the node's rows after every
// unit's stores.
__device__ __forceinline__ void signal_done(u32* counter) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(counter) : "memory");
}

__device__ __forceinline__ u32 load_relaxed(const u32* counter) {
    u32 now;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(counter) : "memory");
    return now;
}

__device__ __forceinline__ void acquire_fence() {
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
}

__device__ __forceinline__ void wait_count(const u32* counter, u32 arrivals) {
    while (load_relaxed(counter) < arrivals) {
    }
}

// Waits for every internal child (code below num_internal) of a node:
// the first two children's counters are loaded together, so ready
// children cost one round trip. The caller fences once after its waits.
__device__ __forceinline__ void wait_children(const u32* counters, u32 cb, u32 ce, u32 c0, u32 c1,
                                              const u32* child_rows, u32 num_internal,
                                              u32 arrivals) {
    const bool w0 = cb < ce && c0 < num_internal, w1 = cb + 1u < ce && c1 < num_internal;
    u32 v0 = w0 ? load_relaxed(counters + c0) : arrivals;
    u32 v1 = w1 ? load_relaxed(counters + c1) : arrivals;
    while (v0 < arrivals) v0 = load_relaxed(counters + c0);
    while (v1 < arrivals) v1 = load_relaxed(counters + c1);
    for (u32 e = cb + 2u; e < ce; ++e) {
        const u32 c = child_rows[e];
        if (c < num_internal) wait_count(counters + c, arrivals);
    }
}

__device__ __forceinline__ void grid_sync(u32* bar, u32* gen) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const u32 next = *gen + 1u;
        u32 old, now;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(bar) : "memory");
        if (old == gridDim.x - 1) {
            asm volatile("st.relaxed.gpu.global.u32 [%0], 0;" :: "l"(bar) : "memory");
            asm volatile("st.release.gpu.global.u32 [%0], %1;" :: "l"(bar + 1), "r"(next) : "memory");
        } else {
            do {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(bar + 1) : "memory");
            } while (now != next);
        }
        *gen = next;
    }
    __syncthreads();
}
"#;

/// The level kernel's first code: the index arrays from the launch's
/// inline words (copied to shared memory) or from the pointers passed,
/// and the next launch's node counters cleared (the engine alternates two
/// counter arrays, so no batch uploads zeros).
const INLINE_PROLOGUE: &str = "__shared__ u32 inline_words[INLINE_INDEX_WORDS];
const bool inline_indices = inl.count > 0u;
if (inline_indices) for (u32 i = threadIdx.x; i < inl.count; i += blockDim.x) inline_words[i] = inl.words[i];
const u32* child_offsets = inline_indices ? inline_words + inl.at[0] : child_offsets_in;
const u32* child_rows = inline_indices ? inline_words + inl.at[1] : child_rows_in;
const u32* tokens = inline_indices ? inline_words + inl.at[2] : tokens_in;
const u32* batch_begin = inline_indices ? inline_words + inl.at[3] : batch_begin_in;
const u32* batch_length = inline_indices ? inline_words + inl.at[4] : batch_length_in;
const u32* roots = inline_indices ? inline_words + inl.at[5] : roots_in;
for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < done_clear; i += gridDim.x * blockDim.x) done_next[i] = 0u;
__syncthreads();
";

/// `const float* P<p> = params + offset;` for every parameter.
pub(crate) fn param_pointers(offsets: &[usize]) -> String {
    offsets
        .iter()
        .enumerate()
        .map(|(p, off)| format!("const float* __restrict__ P{p} = params + {off}ull;\n"))
        .collect()
}

/// Warp coordinates for a cell of `units` units: `j`, replica `rep`, `R`.
pub(crate) fn warp_coordinates(units: usize) -> String {
    format!(
        "const u32 j = gw % {units}u; const u32 rep = gw / {units}u; const u32 R = gwarps / {units}u;\n"
    )
}

/// Stages a program's scalars use (a program compacted from a
/// multi-stage one may keep a larger [`CellProgram::stages`]).
pub fn used_stages(program: &CellProgram) -> usize {
    1 + program.scalars.iter().map(|s| s.stage).max().unwrap_or(0)
}

/// The name of stage `stage`'s kernel of token kernel `name`: `name`
/// itself for stage 0, `name_s<stage>` after.
pub fn token_stage_kernel(name: &str, stage: usize) -> String {
    if stage == 0 {
        name.to_string()
    } else {
        format!("{name}_s{stage}")
    }
}

/// A kernel `name(params, <one float* per output>, vocab)` that runs `cell`
/// once per token below `vocab` (a vertex with that token and no children)
/// and stores output `o` at row `tok` of `outputs[o]` (`(name, width)`).
/// A multi-stage cell (a refactored leaf: its moved products need every
/// unit of its new state) gets one kernel per stage
/// ([`token_stage_kernel`]), launched in order, each taking a scratch
/// row per token before `vocab`: `name(params, outputs..., scratch, vocab)`.
fn token_kernel(
    name: &str,
    block: u32,
    cell: LoweredCell<'_>,
    outputs: &[(&str, usize)],
    param_offsets: &[usize],
) -> Result<String> {
    let rows: Vec<String> = outputs
        .iter()
        .map(|(o, w)| format!("{o} + (u64)tok * {w}u"))
        .collect();
    let rows: Vec<&str> = rows.iter().map(String::as_str).collect();
    let mut params: String = outputs
        .iter()
        .map(|(o, _)| format!("float* {o}, "))
        .collect();
    let stages = used_stages(cell.program);
    if stages > 1 {
        params += "float* scratch, ";
    }
    let mut src = String::new();
    for stage in 0..stages {
        let code = CellWriter::new(cell, None).cell_stage(stage, &rows)?;
        let _ = write!(
            src,
            "extern \"C\" __global__ void __launch_bounds__({block}) {}(const float* __restrict__ params, {params}u32 vocab) {{\n{}const u32 lane = threadIdx.x & 31u;\nconst u32 gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;\nconst u32 gwarps = (gridDim.x * blockDim.x) >> 5;\n{}if (rep < R) {{\n// no children and no tables: only the token and the parameters\nconst bool use_table = false; const u32 num_internal = 0; const float* state = nullptr; const float* table_state = nullptr; const float* token_table = nullptr; const u32* child_rows = nullptr;\n(void)use_table; (void)num_internal; (void)state; (void)table_state; (void)token_table; (void)child_rows;\nfor (u32 tok = rep; tok < vocab; tok += R) {{\nconst u32 n = tok; (void)n;\nconst u32 cb = 0, ce = 0, c0 = 0, c1 = 0; (void)cb; (void)ce; (void)c0; (void)c1;\n{code}}}\n}}\n}}\n",
            token_stage_kernel(name, stage),
            param_pointers(param_offsets),
            warp_coordinates(cell.program.units),
        );
    }
    Ok(src)
}

/// How the level kernel orders a level (or stage) after the ones it reads:
/// a grid barrier after each, or per-node completion counters (see the
/// module docs). With counters the nodes a block (or a warp, when a block
/// holds units of several replicas) computes in a level are waited for and
/// published together: its threads poll the children of one node each,
/// then a block barrier; after the level, a block barrier and one release
/// per node.
struct LevelSync {
    counters: bool,
    /// The block arrives as one (else each warp).
    per_block: bool,
    /// Arrivals that complete a node's stage.
    arrivals: usize,
}

impl LevelSync {
    fn new(counters: bool, units: usize, block_threads: u32) -> Self {
        // a block's warps are consecutive units of one replica (so they
        // walk the same nodes in the same order) when the units are a
        // multiple of the warps per block
        let warps_per_block = (block_threads / 32).max(1) as usize;
        let per_block = units.is_multiple_of(warps_per_block);
        LevelSync {
            counters,
            per_block,
            arrivals: if per_block {
                units / warps_per_block
            } else {
                units
            },
        }
    }

    /// The thread index, thread count and barrier of the arriving group.
    fn group(&self) -> (&'static str, &'static str, &'static str) {
        if self.per_block {
            ("threadIdx.x", "blockDim.x", "__syncthreads();")
        } else {
            ("lane", "32u", "__syncwarp();")
        }
    }

    /// Before the level loop: each thread of the group loads the child
    /// range and first two children of the node it will wait for.
    fn prefetch_first(&self) -> String {
        if !self.counters {
            return String::new();
        }
        let (tid, ..) = self.group();
        format!(
            "u32 qcb = 0, qce = 0, qc0 = 0, qc1 = 0;\nprefetch_node(begin, len, rep + {tid} * R, child_offsets, child_rows, &qcb, &qce, &qc0, &qc1);\n"
        )
    }

    /// At a level's start: wait for the last stage of every internal child
    /// of the group's nodes (leaves are ready: tabulated, or computed
    /// before the levels' first barrier).
    fn before_level(&self, stages: usize) -> String {
        if !self.counters {
            return String::new();
        }
        let (tid, threads, barrier) = self.group();
        format!(
            "{{\nbool waited = false;\nfor (u32 i = rep + {tid} * R; i < len; i += {threads} * R) {{\nu32 cb = qcb, ce = qce, c0 = qc0, c1 = qc1;\nif (i != rep + {tid} * R) prefetch_node(begin, len, i, child_offsets, child_rows, &cb, &ce, &c0, &c1);\nwait_children(done + {}u * num_internal, cb, ce, c0, c1, child_rows, num_internal, {}u);\nwaited = true;\n}}\nif (waited) acquire_fence();\n}}\n{barrier}\n",
            stages - 1,
            self.arrivals
        )
    }

    /// Before stage `stage > 0`: a grid barrier, or wait for the group's
    /// nodes' previous stage.
    fn before_stage(&self, stage: usize) -> String {
        if !self.counters {
            return "}\ngrid_sync(barrier, &bar_gen);\nif (rep < R) {\n".into();
        }
        let (tid, threads, barrier) = self.group();
        format!(
            "{{\nbool waited = false;\nfor (u32 i = rep + {tid} * R; i < len; i += {threads} * R) {{ wait_count(done + {}u * num_internal + begin + i, {}u); waited = true; }}\nif (waited) acquire_fence();\n}}\n{barrier}\n",
            stage - 1,
            self.arrivals
        )
    }

    /// After the group computed stage `stage` of its nodes: one release
    /// per node (none with grid barriers).
    fn publish(&self, stage: usize) -> String {
        if !self.counters {
            return String::new();
        }
        let (tid, threads, barrier) = self.group();
        format!(
            "{barrier}\nfor (u32 i = rep + {tid} * R; i < len; i += {threads} * R) signal_done(done + {stage}u * num_internal + begin + i);\n"
        )
    }

    /// After a level: the grid barrier and, with counters, the next
    /// level's waiter prefetch.
    fn after_level(&self) -> String {
        if !self.counters {
            return "grid_sync(barrier, &bar_gen);\n".into();
        }
        let (tid, ..) = self.group();
        format!(
            "prefetch_node(next_begin, next_len, rep + {tid} * R, child_offsets, child_rows, &qcb, &qce, &qc0, &qc1);\n"
        )
    }

    /// Before the head reads root `root`'s pushed row (each head warp
    /// waits for its own root).
    fn before_head(&self, stages: usize) -> String {
        if !self.counters {
            return String::new();
        }
        format!(
            "if (root < num_internal) {{ wait_count(done + {}u * num_internal + root, {}u); acquire_fence(); }}\n",
            stages - 1,
            self.arrivals
        )
    }
}

impl TreeKernelSpec<'_> {
    fn state_width(&self) -> usize {
        self.internal.program.output_width(0)
    }

    fn push_width(&self) -> usize {
        self.internal.program.output_width(1)
    }

    fn check(&self) -> Result<()> {
        let (s, p) = (self.state_width(), self.push_width());
        for (what, cell) in [("leaf", self.leaf), ("internal", self.internal)] {
            let prog = cell.program;
            if prog.outputs.len() != 2 || prog.output_width(0) != s || prog.output_width(1) != p {
                return Err(gen_error(format!(
                    "the {what} cell must output a state of {s} and a pushed row of {p} columns"
                )));
            }
        }
        if self.block_threads == 0
            || !self.block_threads.is_multiple_of(32)
            || self.block_threads > 1024
        {
            return Err(gen_error(format!(
                "{} threads per block: expected a multiple of 32 up to 1024",
                self.block_threads
            )));
        }
        if self.head.program.outputs.len() != 1 {
            return Err(gen_error("the head must output one row of scores"));
        }
        if used_stages(self.head.program) > 1 {
            return Err(gen_error(format!(
                "the head has {} stages (a product of a product): only vertex cells may \
                 have more than one",
                self.head.program.stages
            )));
        }
        // a leaf cell may read children (one function for every vertex):
        // leaves have none, so its child loops run zero times
        Ok(())
    }

    /// The weight rows the internal cell keeps in registers, if persistent.
    pub fn register_rows(&self) -> Option<Vec<(usize, usize)>> {
        self.persistent_weights
            .then(|| self.internal.program.weight_rows())
    }

    /// Threads per block by default: [`WIDE_CELL_BLOCK`] when the
    /// persistent weights take more than 64 registers per thread, else
    /// [`CELL_BLOCK`].
    pub fn default_block_threads(&self) -> u32 {
        if self.weight_registers() > 64 {
            WIDE_CELL_BLOCK
        } else {
            CELL_BLOCK
        }
    }

    /// Registers per thread the persistent weights take.
    pub fn weight_registers(&self) -> usize {
        let prog = self.internal.program;
        self.register_rows().map_or(0, |rows| {
            rows.iter()
                .map(|&(w, r)| {
                    prog.scalars
                        .iter()
                        .find_map(|s| match s.expr {
                            ScalarExpr::Dot { weight, row, k, .. } if (weight, row) == (w, r) => {
                                Some(chunks(k))
                            }
                            _ => None,
                        })
                        .unwrap_or(0)
                })
                .sum()
        })
    }

    /// Both kernels' source; see the module docs.
    pub fn source(&self) -> Result<String> {
        self.check()?;
        let (s, p) = (self.state_width(), self.push_width());
        let (name, block) = (self.name, self.block_threads);
        let mut src = String::from(PRELUDE);
        let _ = writeln!(
            src,
            "// A small batch's index arrays, passed by value with the launch (no copy\n// to issue): `count` words, array `a` starting at word `at[a]` (child\n// offsets, child rows, tokens, level begins, level lengths, roots).\n#define INLINE_INDEX_WORDS {INLINE_INDEX_WORDS}u\nstruct InlineIndices {{ u32 count; u32 at[6]; u32 words[INLINE_INDEX_WORDS]; }};"
        );
        let _ = writeln!(
            src,
            "// The state row of child code c (see `child_rows`): an internal node's row, or its token's table row.\n__device__ __forceinline__ const float* row_of(u32 c, const float* state, const float* table, u32 num_internal, bool use_table) {{\n    return (c < num_internal || !use_table) ? state + (u64)c * {s}u : table + (u64)(c - num_internal) * {s}u;\n}}\n#define ROW(c) row_of((c), state, table_state, num_internal, use_table)"
        );
        // ---- table kernels: the leaf cell, and the hoisted token values
        src += &token_kernel(
            &format!("{name}_leaf_table"),
            block,
            self.leaf,
            &[("out_state", s), ("out_push", p)],
            self.param_offsets,
        )?;
        if let Some(cell) = self.token_table {
            src += &token_kernel(
                &format!("{name}_token_table"),
                block,
                cell,
                &[("out_table", cell.program.output_width(0))],
                self.param_offsets,
            )?;
        }
        // ---- level kernel
        let registers = self.register_rows();
        let mut weights = String::new();
        if let Some(rows) = &registers {
            let prog = self.internal.program;
            for (q, &(w, r)) in rows.iter().enumerate() {
                let k = prog
                    .scalars
                    .iter()
                    .find_map(|s| match s.expr {
                        ScalarExpr::Dot { weight, row, k, .. } if (weight, row) == (w, r) => {
                            Some(k)
                        }
                        _ => None,
                    })
                    .ok_or_else(|| gen_error("a register row without a dot"))?;
                let _ = writeln!(
                    weights,
                    "float w{q}[{}];\n#pragma unroll\nfor (u32 i = 0; i < {}u; ++i) {{ const u32 t = lane + 32u * i; w{q}[i] = (rep < R && t < {k}u) ? P{w}[(u64)({r}u + j) * {k}u + t] : 0.0f; }}",
                    chunks(k),
                    chunks(k)
                );
            }
        }
        let internal_outputs = [
            format!("state + (u64)n * {s}u"),
            format!("push + (u64)n * {p}u"),
        ];
        let internal_outputs: Vec<&str> = internal_outputs.iter().map(String::as_str).collect();
        let (units, stages) = (self.internal.program.units, self.internal.program.stages);
        let sync = LevelSync::new(self.node_counters, units, self.block_threads);
        // a block's warps are consecutive units of one node when the units
        // are a multiple of them: its cells may cooperate
        let writer = || {
            let w = CellWriter::new(self.internal, registers.clone());
            if sync.per_block {
                w.block_uniform((self.block_threads / 32) as usize)
            } else {
                w
            }
        };
        let (internal_cell, preload) = writer().cell_stage_with_preload(0, &internal_outputs)?;
        weights += &preload;
        // later stages of a multi-stage cell: each after a barrier (or its
        // own nodes' previous stage), its nodes reloading their children
        let mut later_stages = String::new();
        for stage in 1..stages {
            let (code, preload) = writer().cell_stage_with_preload(stage, &internal_outputs)?;
            weights += &preload;
            let _ = write!(
                later_stages,
                "{}for (u32 i = rep; i < len; i += R) {{\nconst u32 n = begin + i;\nconst u32 tok = tokens[n]; (void)tok;\nconst u32 cb = child_offsets[n], ce = child_offsets[n + 1];\nconst u32 c0 = cb < ce ? child_rows[cb] : 0, c1 = cb + 1 < ce ? child_rows[cb + 1] : 0;\n{code}}}\n{}",
                sync.before_stage(stage),
                sync.publish(stage),
            );
        }
        let use_table = self.leaf_table;
        let _ = write!(
            src,
            "extern \"C\" __global__ void __launch_bounds__({block}) {name}_levels(const float* __restrict__ params, float* state, float* push, const float* __restrict__ table_state, const float* __restrict__ table_push, const float* __restrict__ token_table, float* scratch, const u32* child_offsets_in, const u32* child_rows_in, const u32* tokens_in, const u32* batch_begin_in, const u32* batch_length_in, u32 num_batches, u32 num_internal, u32 num_nodes, const u32* roots_in, u32 num_roots, float* scores, u32* barrier, u32* done, const __grid_constant__ InlineIndices inl, u32* done_next, u32 done_clear) {{\n{}const bool use_table = {use_table}; (void)token_table; (void)scratch; (void)done;\n{INLINE_PROLOGUE}// the barrier generation (thread 0's copy; no block can arrive before every block has read it)\nu32 bar_gen = 0;\nif (threadIdx.x == 0) bar_gen = barrier_generation(barrier);\nconst u32 lane = threadIdx.x & 31u;\nconst u32 gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;\nconst u32 gwarps = (gridDim.x * blockDim.x) >> 5;\n",
            param_pointers(self.param_offsets),
        );
        src += &self.leaf_phase()?;
        let _ = write!(
            src,
            "{{\n{}{weights}\nu32 begin = num_batches > 0 ? batch_begin[0] : 0, len = num_batches > 0 ? batch_length[0] : 0;\n// this warp's first node of a level, its child range and first two child rows, loaded ahead (before the barrier)\nu32 pcb = 0, pce = 0, pc0 = 0, pc1 = 0;\nprefetch_node(begin, len, rep, child_offsets, child_rows, &pcb, &pce, &pc0, &pc1);\n{}for (u32 b = 0; b < num_batches; ++b) {{\nconst u32 next_begin = b + 1 < num_batches ? batch_begin[b + 1] : 0, next_len = b + 1 < num_batches ? batch_length[b + 1] : 0;\nif (rep < R) {{\n{}for (u32 i = rep; i < len; i += R) {{\nconst u32 n = begin + i;\nconst u32 tok = tokens[n]; (void)tok;\nu32 cb = pcb, ce = pce, c0 = pc0, c1 = pc1;\nif (i != rep) {{ cb = child_offsets[n]; ce = child_offsets[n + 1]; c0 = cb < ce ? child_rows[cb] : 0; c1 = cb + 1 < ce ? child_rows[cb + 1] : 0; }}\n{internal_cell}}}\n{}{later_stages}}}\nprefetch_node(next_begin, next_len, rep, child_offsets, child_rows, &pcb, &pce, &pc0, &pc1);\n{}begin = next_begin; len = next_len;\n}}\n}}\n",
            warp_coordinates(self.internal.program.units),
            sync.prefetch_first(),
            sync.before_level(stages),
            sync.publish(0),
            sync.after_level(),
        );
        src += &self.head_phase(&sync.before_head(stages))?;
        src += "}\n";
        Ok(src)
    }

    /// Without the leaf table: the leaf cell on every leaf, stage by stage,
    /// then a grid barrier (nothing with the table). Code inside a level
    /// kernel (its parameters, `lane`, `gw`, `gwarps`, `bar_gen` in scope).
    pub(crate) fn leaf_phase(&self) -> Result<String> {
        if self.leaf_table {
            return Ok(String::new());
        }
        let (s, p) = (self.state_width(), self.push_width());
        let rows = [
            format!("state + (u64)n * {s}u"),
            format!("push + (u64)n * {p}u"),
        ];
        let rows: Vec<&str> = rows.iter().map(String::as_str).collect();
        let mut src = String::new();
        for stage in 0..used_stages(self.leaf.program) {
            let code = CellWriter::new(self.leaf, None).cell_stage(stage, &rows)?;
            let _ = write!(
                src,
                "{{\n{}if (rep < R) {{\nfor (u32 n = num_internal + rep; n < num_nodes; n += R) {{\nconst u32 tok = tokens[n]; (void)tok;\nconst u32 cb = child_offsets[n], ce = child_offsets[n + 1]; (void)cb; (void)ce;\nconst u32 c0 = 0, c1 = 0; (void)c0; (void)c1;\n{code}}}\n}}\n}}\ngrid_sync(barrier, &bar_gen);\n",
                warp_coordinates(self.leaf.program.units)
            );
        }
        Ok(src)
    }

    /// The head cell on every root (code inside a level kernel).
    /// The head over every root; `before_root` runs before a root's pushed
    /// row is read (the wait for its node, with node counters).
    pub(crate) fn head_phase(&self, before_root: &str) -> Result<String> {
        let p = self.push_width();
        let classes = self.head.program.output_width(0);
        let head_cell =
            CellWriter::new(self.head, None).cell(&[&format!("scores + (u64)r * {classes}u")])?;
        Ok(format!(
            "{{\n{}if (rep < R) {{\nfor (u32 r = rep; r < num_roots; r += R) {{\nconst u32 root = roots[r];\n{before_root}const float* hin = (root < num_internal || !use_table) ? push + (u64)root * {p}u : table_push + (u64)tokens[root] * {p}u;\nconst u32 cb = 0, ce = 0, c0 = 0, c1 = 0; (void)cb; (void)ce; (void)c0; (void)c1; const u32 tok = 0; (void)tok;\n{head_cell}}}\n}}\n}}\n",
            warp_coordinates(self.head.program.units)
        ))
    }
}
