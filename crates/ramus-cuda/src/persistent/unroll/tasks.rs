//! Pass 3 of a batch's lowering, the batch's order: every phase of every
//! graph over the batching tasks, forward then backward, with the
//! gathers, the head's inputs, the child-gradient scatters, the parameter
//! gradients not written in place and the optimizer update between them.

use ramus_core::graph::NodeId;
use ramus_core::graph::{NodeKind, Role, Source};
use ramus_core::vpps::isa::{
    NO_INDEX, OP_NOP, OP_ROWS, OP_UPDATE, OP_UPDATE_DENSE, ROWS_ACCUMULATE, ROWS_DST_ABSOLUTE,
    ROWS_SRC_ABSOLUTE,
};
use ramus_core::vpps::{Placement, OP_HOST};
use ramus_graph::Task;

use super::{err, u32_of, ChildLink, HostWork, RowCopy, Unroller};
use crate::error::Result;
use crate::persistent::program::GraphKey;

/// The phases of a vertex function's plan: before the batching tasks (on
/// every row at once), per batching task, after them.
const EAGER: usize = 0;
const PER_TASK: usize = 1;
const LAZY: usize = 2;

/// The rows and edges `[r0, r1, e0, e1]` of batching task `task`.
fn task_rows(task: &Task) -> [usize; 4] {
    [
        task.row_offset as usize,
        (task.row_offset + task.len) as usize,
        task.edge_offset as usize,
        (task.edge_offset + task.edge_len) as usize,
    ]
}

impl Unroller<'_> {
    /// A host task for `work` after `deps` (see [`HostWork`]).
    pub(super) fn host_task(&mut self, work: HostWork, deps: Vec<u32>) -> Result<u32> {
        let index = u32_of(self.host_work.len(), "host work index")?;
        self.host_work.push(work);
        self.push_any(OP_HOST, 0, vec![index], deps, 1)
    }

    /// A row copy task `dst rows (+)= src rows` with its dependencies.
    pub(super) fn rows_task(&mut self, copy: RowCopy, deps: Vec<u32>) -> Result<u32> {
        let RowCopy {
            flags,
            rows,
            width,
            dst,
            src,
        } = copy;
        // OP_ROWS: rows, width, dst, dst_stride, src, src_stride, dst_index, src_index
        let ops = vec![
            u32_of(rows, "rows")?,
            u32_of(width, "width")?,
            dst.0,
            u32_of(dst.1, "stride")?,
            src.0,
            u32_of(src.1, "stride")?,
            dst.2,
            src.2,
        ];
        self.push_any(OP_ROWS, flags, ops, deps, rows * width)
    }

    /// The non-cached parameter whose gradient `n` (a sum over rows) is,
    /// when that is all `n` is for: it then accumulates straight into the
    /// parameter's gradient.
    pub(super) fn direct_grad(&self, key: GraphKey, n: NodeId) -> Option<usize> {
        let g = self.graph(key);
        let mut roles = g.outputs.iter().filter(|o| o.node == n || o.aux == Some(n));
        let first = roles.next()?;
        let Role::ParamGrad(p) = first.role else {
            return None;
        };
        let read = g.nodes.iter().any(|x| x.inputs.contains(&n));
        (roles.next().is_none() && !read && self.prog.cached[p].is_none()).then_some(p)
    }

    /// Gathers of task rows `r`: children's scattered rows into the
    /// function's gather inputs, and the children's pushes into the sums
    /// of their gathered states (see [`PersistentProgram::pushed_sum`]):
    /// an atomic row add per edge from the child's scattered row into its
    /// parent's row of the sum, with the gather's dependencies, so that it
    /// chains where the gather does.
    pub(super) fn gathers(&mut self, f: usize, r: [usize; 4]) -> Result<()> {
        let key = GraphKey::Forward(f);
        let g = self.graph(key);
        let w = self.model.state_width;
        let s = self.s;
        // each pushed sum: its node, the column it starts at in the states,
        // its width and where its rows are
        let pushed = self
            .prog
            .pushed_sums(key)
            .map(|(sum, column)| Ok((sum, column, g.nodes[sum].ty.width(), self.loc(key, sum)?.0)))
            .collect::<Result<Vec<_>>>()?;
        for (n, node) in g.nodes.iter().enumerate() {
            let (link, index) = match node.kind {
                NodeKind::Input(Source::GatherAll) => (
                    ChildLink::Edges,
                    self.functions[f]
                        .gather_all_src
                        .ok_or_else(|| err("no gather index"))?,
                ),
                NodeKind::Input(Source::Gather(k)) => (
                    ChildLink::Child(k),
                    *self.functions[f]
                        .gather_src
                        .get(&k)
                        .ok_or_else(|| err("no gather index"))?,
                ),
                _ => continue,
            };
            let (lo, hi) = link.range(r);
            for (a, b) in self.chunks(lo, hi, w) {
                let mut deps = Vec::new();
                for i in a..b {
                    if let Some((cf, cr)) = self.child_of(f, link, i) {
                        if let Some(sc) = self.model.functions[cf].scatter {
                            self.deps_of(GraphKey::Forward(cf), sc, cr, cr + 1, &mut deps);
                        }
                    }
                }
                if link == ChildLink::Edges {
                    for &(sum, column, width, sum_base) in &pushed {
                        let t = self.rows_task(
                            RowCopy {
                                flags: ROWS_ACCUMULATE | ROWS_SRC_ABSOLUTE,
                                rows: b - a,
                                width,
                                dst: (
                                    u32_of(sum_base, "offset")?,
                                    width,
                                    self.up(self.functions[f].edge_parent + a)?,
                                ),
                                src: (u32_of(column, "column")?, 0, self.up(index + a)?),
                            },
                            deps.clone(),
                        )?;
                        for &parent in &s.functions[f].edge_parent[a..b] {
                            let parent = parent as usize;
                            self.record(key, sum, parent, parent + 1, t);
                        }
                    }
                }
                let (dbase, _) = self.loc(key, n)?;
                let t = self.rows_task(
                    RowCopy {
                        flags: ROWS_SRC_ABSOLUTE,
                        rows: b - a,
                        width: w,
                        dst: (u32_of(dbase + a * w, "offset")?, w, NO_INDEX),
                        src: (0, 0, self.up(index + a)?),
                    },
                    deps,
                )?;
                self.record(key, n, a, b, t);
            }
        }
        Ok(())
    }

    /// Child-gradient scatter-adds of task rows `r` into the children's
    /// state-gradient rows (unless the fused groups computing them add
    /// them there themselves: [`PersistentProgram::scattered_child_grads`]).
    pub(super) fn child_grads(&mut self, f: usize, r: [usize; 4]) -> Result<()> {
        let key = GraphKey::Backward(f);
        let g = self.graph(key);
        let w = self.model.state_width;
        for o in &g.outputs {
            let (link, index) = match o.role {
                Role::ChildGradAll => (
                    ChildLink::Edges,
                    self.functions[f]
                        .child_grad_all_dst
                        .ok_or_else(|| err("no child-gradient index"))?,
                ),
                Role::ChildGrad(k) => (
                    ChildLink::Child(k),
                    *self.functions[f]
                        .child_grad_dst
                        .get(&k)
                        .ok_or_else(|| err("no child-gradient index"))?,
                ),
                _ => continue,
            };
            if Some(o.node) == self.prog.scattered_child_grads(key) {
                // added by the fused groups that compute them
                continue;
            }
            let (lo, hi) = link.range(r);
            for (a, b) in self.chunks(lo, hi, w) {
                let mut deps = Vec::new();
                self.deps_of(key, o.node, a, b, &mut deps);
                let (sbase, sstride) = self.loc(key, o.node)?;
                let t = self.rows_task(
                    RowCopy {
                        flags: ROWS_ACCUMULATE | ROWS_DST_ABSOLUTE,
                        rows: b - a,
                        width: w,
                        dst: (0, 0, self.up(index + a)?),
                        src: (u32_of(sbase + a * sstride, "offset")?, sstride, NO_INDEX),
                    },
                    deps,
                )?;
                self.record_child_grads(f, link, a, b, t);
            }
        }
        Ok(())
    }

    /// Records task `t` as a writer of the state-gradient rows of the
    /// children that rows `a..b` of function `f`'s child gradients (`link`)
    /// go to.
    pub(super) fn record_child_grads(
        &mut self,
        f: usize,
        link: ChildLink,
        a: usize,
        b: usize,
        t: u32,
    ) {
        for i in a..b {
            if let Some((cf, cr)) = self.child_of(f, link, i) {
                let cfunc = &self.model.functions[cf];
                if let Some(sg) = cfunc.output_grad_node(Role::Scatter) {
                    self.record(GraphKey::Backward(cf), sg, cr, cr + 1, t);
                }
            }
        }
    }

    /// The vertex function and row of the child that row `i` of function
    /// `f`'s gathers (`link`) reads, if there is one.
    pub(super) fn child_of(&self, f: usize, link: ChildLink, i: usize) -> Option<(usize, usize)> {
        let s = self.s;
        let c = link.child(&s.functions[f], i)? as usize;
        Some((s.vertex_function[c] as usize, s.vertex_row[c] as usize))
    }

    pub(super) fn all_rows(&self, f: usize) -> [usize; 4] {
        let rows = &self.s.functions[f];
        [0, rows.rows(), 0, rows.edges()]
    }

    /// Pass 3: every task of the batch.
    pub(super) fn tasks(&mut self) -> Result<()> {
        let s = self.s;
        let n_fn = self.model.functions.len();
        for f in 0..n_fn {
            self.phase(GraphKey::Forward(f), EAGER, self.all_rows(f))?;
        }
        for task in &s.tasks {
            let r = task_rows(task);
            self.gathers(task.function, r)?;
            self.phase(GraphKey::Forward(task.function), PER_TASK, r)?;
        }
        for f in 0..n_fn {
            self.phase(GraphKey::Forward(f), LAZY, self.all_rows(f))?;
        }
        self.head_input()?;
        let head_rows = [0, self.head_vertices.len(), 0, 0];
        self.phase(GraphKey::HeadForward, 0, head_rows)?;
        self.phase(GraphKey::HeadBackward, 0, head_rows)?;
        self.head_input_grads()?;
        for f in 0..n_fn {
            self.phase(GraphKey::Backward(f), EAGER, self.all_rows(f))?;
        }
        for task in s.tasks.iter().rev() {
            let r = task_rows(task);
            self.phase(GraphKey::Backward(task.function), PER_TASK, r)?;
            self.child_grads(task.function, r)?;
        }
        for f in 0..n_fn {
            self.phase(GraphKey::Backward(f), LAZY, self.all_rows(f))?;
        }
        self.param_grads()?;
        match self.defer_updates {
            true => Ok(()),
            false => self.updates(),
        }
    }

    /// The head's input: the pushed rows of the head vertices.
    fn head_input(&mut self) -> Result<()> {
        let model = self.model;
        let s = self.s;
        let hf = GraphKey::HeadForward;
        let h = self.head_vertices.len();
        if let Some(inp) = model.head.forward.input_node(Source::HeadInput) {
            let pw = model.head.forward.nodes[inp].ty.width();
            for (a, b) in self.chunks(0, h, pw) {
                let mut deps = Vec::new();
                for i in a..b {
                    let v = self.head_vertices[i] as usize;
                    let (f, row) = (s.vertex_function[v] as usize, s.vertex_row[v] as usize);
                    if let Some(pn) = model.functions[f].push {
                        self.deps_of(GraphKey::Forward(f), pn, row, row + 1, &mut deps);
                    }
                }
                let (dbase, _) = self.loc(hf, inp)?;
                let t = self.rows_task(
                    RowCopy {
                        flags: ROWS_SRC_ABSOLUTE,
                        rows: b - a,
                        width: pw,
                        dst: (u32_of(dbase + a * pw, "offset")?, pw, NO_INDEX),
                        src: (0, 0, self.up(self.push_src_at + a)?),
                    },
                    deps,
                )?;
                self.record(hf, inp, a, b, t);
            }
        }
        Ok(())
    }

    /// The head input's gradients added into the pushing functions' rows.
    fn head_input_grads(&mut self) -> Result<()> {
        let model = self.model;
        let s = self.s;
        let hb = GraphKey::HeadBackward;
        let h = self.head_vertices.len();
        if let Some(out) = model.head.backward.output(Role::HeadInputGrad) {
            let pw = model.head.backward.nodes[out.node].ty.width();
            for (a, b) in self.chunks(0, h, pw) {
                let mut deps = Vec::new();
                self.deps_of(hb, out.node, a, b, &mut deps);
                let (sbase, sstride) = self.loc(hb, out.node)?;
                let t = self.rows_task(
                    RowCopy {
                        flags: ROWS_ACCUMULATE | ROWS_DST_ABSOLUTE,
                        rows: b - a,
                        width: pw,
                        dst: (0, 0, self.up(self.head_grad_dst_at + a)?),
                        src: (u32_of(sbase + a * sstride, "offset")?, sstride, NO_INDEX),
                    },
                    deps,
                )?;
                for i in a..b {
                    let v = self.head_vertices[i] as usize;
                    let (f, row) = (s.vertex_function[v] as usize, s.vertex_row[v] as usize);
                    let func = &model.functions[f];
                    if let Some(pg) = func.output_grad_node(Role::Push) {
                        self.record(GraphKey::Backward(f), pg, row, row + 1, t);
                    }
                }
            }
        }
        Ok(())
    }

    /// The parameter gradients not written in place, added into their
    /// slots.
    fn param_grads(&mut self) -> Result<()> {
        let n_fn = self.model.functions.len();
        let hb = GraphKey::HeadBackward;
        for key in (0..n_fn).map(GraphKey::Backward).chain([hb]) {
            let g = self.graph(key);
            for o in &g.outputs {
                match o.role {
                    Role::ParamRowGrad(p) => {
                        let f = key
                            .function()
                            .ok_or_else(|| err("row gradient in the head"))?;
                        let tokens = self.functions[f].tokens.ok_or_else(|| err("no tokens"))?;
                        let w = g.nodes[o.node].ty.width();
                        let grad =
                            self.prog.params.grad[p].ok_or_else(|| err("no gradient slot"))?;
                        let rows = self.rows(key, g.nodes[o.node].ty.space);
                        for (a, b) in self.chunks(0, rows, w) {
                            let mut deps = Vec::new();
                            self.deps_of(key, o.node, a, b, &mut deps);
                            let (sbase, sstride) = self.loc(key, o.node)?;
                            self.rows_task(
                                RowCopy {
                                    flags: ROWS_ACCUMULATE,
                                    rows: b - a,
                                    width: w,
                                    dst: (u32_of(grad, "offset")?, w, self.up(tokens + a)?),
                                    src: (
                                        u32_of(sbase + a * sstride, "offset")?,
                                        sstride,
                                        NO_INDEX,
                                    ),
                                },
                                deps,
                            )?;
                        }
                    }
                    Role::ParamGrad(p)
                        if self.prog.cached[p].is_none()
                            && self.direct_grad(key, o.node).is_none() =>
                    {
                        let len = self.prog.params.len[p];
                        let grad =
                            self.prog.params.grad[p].ok_or_else(|| err("no gradient slot"))?;
                        let mut deps = Vec::new();
                        self.deps_of(key, o.node, 0, 1, &mut deps);
                        let src = self.row_at(key, o.node, 0)?;
                        self.rows_task(
                            RowCopy {
                                flags: ROWS_ACCUMULATE,
                                rows: 1,
                                width: len,
                                dst: (u32_of(grad, "offset")?, len, NO_INDEX),
                                src: (src, len, NO_INDEX),
                            },
                            deps,
                        )?;
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }

    /// The update, after everything.
    fn updates(&mut self) -> Result<()> {
        let model = self.model;
        let all: Vec<u32> = (0..self.g.len() as u32).collect();
        let sink = self.push_any(OP_NOP, 0, Vec::new(), all, 1)?;
        if !self.prog.matrices.is_empty() && self.grads_in_registers {
            self.push(OP_UPDATE, 0, Vec::new(), vec![sink], 1, Placement::Every)?;
        }
        for (p, spec) in model.params.iter().enumerate() {
            if self.prog.cached[p].is_some() {
                continue;
            }
            self.dense_update(p, &spec.shape, vec![sink])?;
        }
        Ok(())
    }

    /// Update tasks (chunks of rows) for parameter `p` in the pool: its
    /// touched rows for a row-gradient parameter, else all.
    pub(super) fn dense_update(&mut self, p: usize, shape: &[usize], deps: Vec<u32>) -> Result<()> {
        let params = &self.prog.params;
        let grad = params.grad[p].ok_or_else(|| err("no gradient slot"))?;
        let width = *shape.last().unwrap_or(&1);
        let (rows, index) = match self.update_rows.get(&p) {
            Some(&(at, n)) => (n, Some(at)),
            None => (params.len[p] / width.max(1), None),
        };
        // a row list indexes from the parameter's start; dense chunks start
        // at their own first row
        let first = |a: usize| if index.is_some() { 0 } else { a * width };
        for (a, b) in self.chunks(0, rows, width) {
            let ops = vec![
                u32_of(b - a, "rows")?,
                u32_of(width, "width")?,
                u32_of(params.value[p] + first(a), "offset")?,
                u32_of(grad + first(a), "offset")?,
                u32_of(params.first[p] + first(a), "offset")?,
                u32_of(params.second[p] + first(a), "offset")?,
                match index {
                    Some(at) => self.up(at + a)?,
                    None => NO_INDEX,
                },
            ];
            self.push_any(OP_UPDATE_DENSE, 0, ops, deps.clone(), (b - a) * width)?;
        }
        Ok(())
    }
}
