//! Pass 3 of a batch's lowering, the graphs' plans: each phase's steps
//! (fused groups and ops) over a batching task's rows, cut into
//! instructions.

use ramus_core::fusion::{InputKind, Step};
use ramus_core::graph::Space;
use ramus_core::vpps::isa::OP_FUSED;

use super::{err, u32_of, ChildLink, Unroller, MIN_CHUNK_ELEMENTS};
use crate::error::Result;
use crate::persistent::program::GraphKey;

impl Unroller<'_> {
    /// Rows `lo..hi` of `width` floats each cut into instructions: into
    /// `spread` pieces (the processors) or fewer, each at least
    /// [`MIN_CHUNK_ELEMENTS`] wide where it has the rows. Every op over the
    /// same rows is cut the same way (whatever its width), so row `i`'s
    /// chain of instructions waits only for row `i`'s producers, and a
    /// level's elementwise work spreads over the processors instead of
    /// queueing on a few: one row per instruction on narrow levels
    /// (`docs/benchmarks.md#persistent-lowering-row-chunks`).
    pub(super) fn chunks(&self, lo: usize, hi: usize, width: usize) -> Vec<(usize, usize)> {
        let rows = hi.saturating_sub(lo);
        let step = rows
            .div_ceil(self.spread.max(1))
            .max(MIN_CHUNK_ELEMENTS.div_ceil(width.max(1)))
            .max(1);
        (lo..hi)
            .step_by(step)
            .map(|a| (a, (a + step).min(hi)))
            .collect()
    }

    /// Rows `r` of a fused group of edge space cut at the vertex cuts
    /// ([`Self::chunks`] of the vertices), so a chunk holds every child edge
    /// of its vertices: a vertex's edge work that reads the vertex (its
    /// children's gate gradients) or that the vertex sums (a Tree-LSTM's
    /// forget gates) then depends on, or is, one instruction, and runs in
    /// the vertex's chain on one processor instead of a barrier apart. `None`
    /// where the edges are not the vertices' (rows of another task).
    pub(super) fn vertex_cut_edges(
        &self,
        key: GraphKey,
        r: [usize; 4],
        width: usize,
    ) -> Option<Vec<(usize, usize)>> {
        key.function()?;
        if self.span(key, Space::Vertex, Space::Edge, r[0], r[1]) != (r[2], r[3]) {
            return None;
        }
        let cuts = self.chunks(r[0], r[1], width).into_iter();
        Some(
            cuts.map(|(a, b)| self.span(key, Space::Vertex, Space::Edge, a, b))
                .filter(|(a, b)| b > a)
                .collect(),
        )
    }

    /// Runs phase `phase` of graph `key` over rows `r0..r1` / edges `e0..e1`.
    pub(super) fn phase(&mut self, key: GraphKey, phase: usize, r: [usize; 4]) -> Result<()> {
        let plan = self.prog.plan(key);
        for (i, step) in plan.phases[phase].steps.iter().enumerate() {
            match step {
                Step::Fused(group) if self.prog.is_epilogue(key, group) => {}
                Step::Fused(group) => {
                    let case = self.prog.case(key, phase, i)?;
                    self.fused(key, group, case, r)?;
                }
                Step::Op(n) => self.op(key, *n, r)?,
            }
        }
        Ok(())
    }

    pub(super) fn space_range(space: Space, r: [usize; 4]) -> (usize, usize) {
        match space {
            Space::Vertex => (r[0], r[1]),
            Space::Edge => (r[2], r[3]),
            Space::Static => (0, 1),
        }
    }

    pub(super) fn fused(
        &mut self,
        key: GraphKey,
        group: &ramus_core::fusion::FusedGroup,
        case: u16,
        r: [usize; 4],
    ) -> Result<()> {
        let g = self.graph(key);
        let (lo, hi) = Self::space_range(group.space, r);
        let f = key.function();
        let cuts = match group.space {
            Space::Edge if self.prog.vertex_bound(key, group) => {
                self.vertex_cut_edges(key, r, group.width)
            }
            _ => None,
        };
        let cuts = cuts.unwrap_or_else(|| self.chunks(lo, hi, group.width));
        // child gradients the group adds into the children's rows itself:
        // their concat, the function and the upload offset of the rows'
        // index (see `PersistentProgram::scattered_child_grads`)
        let scattered = match (self.prog.scattered_child_grads(key), f) {
            (Some(concat), Some(fi)) if group.concat_writes.iter().any(|w| w.concat == concat) => {
                let dst = self.functions[fi]
                    .child_grad_all_dst
                    .ok_or_else(|| err("no child-gradient index"))?;
                Some((concat, fi, dst))
            }
            _ => None,
        };
        for (a, b) in cuts {
            let mut ops = vec![u32_of((b - a) * group.width, "elements")?];
            let mut deps = Vec::new();
            let mut csr = Vec::new();
            for input in &group.inputs {
                let x_space = g.nodes[input.node].ty.space;
                match input.kind {
                    InputKind::PerElement => {
                        ops.push(self.row_at(
                            key,
                            input.node,
                            if x_space == Space::Static { 0 } else { a },
                        )?);
                        let (xa, xb) = self.span(key, group.space, x_space, a, b);
                        self.deps_of(key, input.node, xa, xb, &mut deps);
                    }
                    InputKind::Broadcast => {
                        ops.push(self.row_at(key, input.node, 0)?);
                        self.deps_of(key, input.node, 0, 1, &mut deps);
                    }
                    InputKind::Window { source, stride, .. } => {
                        let (base, _) = self.loc(key, source)?;
                        ops.push(u32_of(base + a * stride, "offset")?);
                        self.deps_of(key, source, a, b, &mut deps);
                    }
                    InputKind::ChildSum { source } | InputKind::ParentRow { source } => {
                        let fi = f.ok_or_else(|| err("a child read outside a vertex function"))?;
                        ops.push(self.row_at(key, source, 0)?);
                        let src_space = g.nodes[source].ty.space;
                        let (xa, xb) = self.span(key, group.space, src_space, a, b);
                        self.deps_of(key, source, xa, xb, &mut deps);
                        let index = if matches!(input.kind, InputKind::ChildSum { .. }) {
                            self.functions[fi].edge_offsets
                        } else {
                            self.functions[fi].edge_parent
                        };
                        csr.push(self.up(index + a)?);
                    }
                }
            }
            for &o in &group.outputs {
                ops.push(self.row_at(key, o, a)?);
            }
            for w in &group.concat_writes {
                match scattered {
                    // the children's state-gradient rows of edges a..b
                    Some((concat, _, dst)) if concat == w.concat => ops.push(self.up(dst + a)?),
                    _ => ops.push(self.row_at(key, w.concat, a)?),
                }
            }
            ops.extend(csr);
            let t = self.push_any(OP_FUSED, case, ops, deps, (b - a) * group.width)?;
            for &o in &group.outputs {
                self.record(key, o, a, b, t);
            }
            for w in &group.concat_writes {
                match scattered {
                    Some((concat, fi, _)) if concat == w.concat => {
                        self.record_child_grads(fi, ChildLink::Edges, a, b, t)
                    }
                    _ => self.record(key, w.concat, a, b, t),
                }
            }
        }
        Ok(())
    }
}
