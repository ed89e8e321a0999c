//! The tasks of one op node outside the fused groups: products, column
//! copies, child sums and expansions, row sums and broadcasts, embeddings
//! and the loss ([`Unroller::op`]).

use ramus_core::graph::{Graph, Node, NodeId, NodeKind, Space};
use ramus_core::op::OpDef;
use ramus_core::ops::{BroadcastRows, MatMul, Op, SumRows};
use ramus_core::vpps::isa::{
    NO_INDEX, OP_BROADCAST_ROWS, OP_MATVEC, OP_MATVEC_T, OP_OUTER, OP_SUM_CHILDREN, OP_SUM_ROWS,
    OP_XENT, PRODUCT_ITEM_WORDS, ROWS_ACCUMULATE,
};
use ramus_core::vpps::Placement;

use super::{err, instruction_support, u32_of, GradientGemm, HostWork, RowCopy, Unroller};
use crate::error::Result;
use crate::persistent::program::GraphKey;

/// The setup every op's tasks share: its graph, node, output width and
/// the output rows of this phase.
#[derive(Clone, Copy)]
struct OpSite<'a> {
    key: GraphKey,
    n: NodeId,
    g: &'a Graph,
    node: &'a Node,
    out_space: Space,
    width: usize,
    lo: usize,
    hi: usize,
    /// The phase's task rows per space.
    r: [usize; 4],
}

impl OpSite<'_> {
    /// The node's input `i`.
    fn arg(&self, i: usize) -> NodeId {
        self.node.inputs[i]
    }

    /// The vertex function the node's graph belongs to (an error naming
    /// `op` in the head's graphs).
    fn function(&self, op: &str) -> Result<usize> {
        self.key
            .function()
            .ok_or_else(|| err(format!("{op} outside a vertex function")))
    }
}

impl<'a> Unroller<'a> {
    /// The shared setup of node `n` of graph `key` over task rows `r`.
    fn site(&self, key: GraphKey, n: NodeId, r: [usize; 4]) -> OpSite<'a> {
        let g = self.graph(key);
        let node = &g.nodes[n];
        let out_space = node.ty.space;
        let (lo, hi) = Self::space_range(out_space, r);
        OpSite {
            key,
            n,
            g,
            node,
            out_space,
            width: node.ty.width(),
            lo,
            hi,
            r,
        }
    }

    /// The tasks of op node `n` of graph `key` over task rows `r`.
    pub(super) fn op(&mut self, key: GraphKey, n: NodeId, r: [usize; 4]) -> Result<()> {
        let site = self.site(key, n, r);
        let NodeKind::Op(op) = &site.node.kind else {
            return Ok(());
        };
        match op {
            Op::MatMul(mm) => self.matmul_op(site, *mm),
            Op::Concat(_) | Op::Slice(_) | Op::Reshape(_) | Op::Pad(_) => {
                self.column_copy_op(site, op)
            }
            Op::SumChildren(_) => self.sum_children_op(site),
            Op::ExpandChildren(_) => self.expand_children_op(site),
            Op::SumRows(sr) => self.sum_rows_op(site, *sr),
            Op::BroadcastRows(br) => self.broadcast_rows_op(site, *br),
            Op::Embedding(_) => self.embedding_op(site),
            Op::SoftmaxXent(_) => self.xent_op(site, true),
            Op::SoftmaxXentBackward(_) => self.xent_op(site, false),
            // elementwise ops run inside fused groups, never alone
            ramus_core::elementwise_op!()
            | Op::RowMatMul(_)
            | Op::EmbeddingUnk(_)
            | Op::EmbeddingUnkBackward(_)
            | ramus_core::image_op!() => {
                let why = instruction_support(op)
                    .err()
                    .unwrap_or("has no persistent-kernel instruction (it runs in fused groups)");
                Err(err(format!(
                    "model `{}`: op `{}` (node %{n} of {key:?}) {why}",
                    self.model.name,
                    op.signature()
                )))
            }
        }
    }

    /// A matrix product's tasks: a weight gradient (an outer product over
    /// the rows) or a product with a cached weight.
    fn matmul_op(&mut self, site: OpSite<'a>, mm: MatMul) -> Result<()> {
        let OpSite { key, n, g, r, .. } = site;
        let arg = |i: usize| site.arg(i);
        let a_space = g.nodes[arg(0)].ty.space;
        let (lo, hi) = Self::space_range(a_space, r);
        if hi <= lo {
            return Ok(());
        }
        if let Some(m) = self.outer_product(key, n)? {
            return self.outer_product_op(site, m, (lo, hi));
        }
        let NodeKind::Param(p) = g.nodes[arg(1)].kind else {
            return Err(err(format!(
                "product %{n} of {key:?} has no weight operand"
            )));
        };
        let Some(m) = self.prog.cached[p] else {
            return Err(err(format!(
                "product %{n} of {key:?} with an uncached weight"
            )));
        };
        let opcode = if mm.trans_b { OP_MATVEC } else { OP_MATVEC_T };
        if mm.trans_a {
            return Err(err(format!(
                "product %{n} of {key:?} has an unsupported form"
            )));
        }
        let spec = &self.prog.matrices[usize::from(m)];
        let load = (hi - lo) * spec.rows * spec.cols;
        let mut deps = Vec::new();
        self.deps_of(key, arg(0), lo, hi, &mut deps);
        // with a bias epilogue the product writes its add's rows
        let (out, bias) = match self.prog.epilogue(key, n) {
            Some((add, bias)) => (add, self.row_at(key, bias, 0)?),
            None => (n, NO_INDEX),
        };
        let (xs, ys) = (self.rows_of(key, arg(0))?, self.rows_of(key, out)?);
        let (in_width, out_width) = match opcode {
            OP_MATVEC => (spec.cols, spec.rows),
            _ => (spec.rows, spec.cols),
        };
        // (rows cuBLAS can address: no overlapping rows)
        if hi - lo >= self.host_items && xs.stride >= in_width && ys.stride >= out_width {
            // the output starts zeroed; cuBLAS adds the product to the
            // bias, copied into every row first
            if bias != NO_INDEX {
                let width = out_width;
                for (a, b) in self.chunks(lo, hi, width) {
                    let dst = (ys.row(a)?, ys.stride, NO_INDEX);
                    let t = self.rows_task(
                        RowCopy {
                            flags: 0,
                            rows: b - a,
                            width,
                            dst,
                            src: (bias, 0, NO_INDEX),
                        },
                        vec![],
                    )?;
                    deps.push(t);
                }
            }
            let work = HostWork::Product {
                matrix: m,
                transposed: opcode == OP_MATVEC_T,
                rows: hi - lo,
                input: xs.base + lo * xs.stride,
                input_stride: xs.stride,
                output: ys.base + lo * ys.stride,
                output_stride: ys.stride,
            };
            let t = self.host_task(work, deps)?;
            self.record(key, out, lo, hi, t);
            return Ok(());
        }
        let mut ops = Vec::with_capacity(PRODUCT_ITEM_WORDS * (hi - lo));
        for i in lo..hi {
            ops.extend([xs.row(i)?, ys.row(i)?, bias]);
        }
        let t = self.push(opcode, m, ops, deps, load, Placement::Holders { matrix: m })?;
        self.record(key, out, lo, hi, t);
        Ok(())
    }

    /// A weight gradient, the outer product of rows `lo..hi` of the two
    /// operands summed into matrix `m`'s gradient: one task for the rows
    /// (an (a, b) offset pair per row), host work, or a cuBLAS product
    /// after the batch.
    fn outer_product_op(
        &mut self,
        site: OpSite<'a>,
        m: u16,
        (lo, hi): (usize, usize),
    ) -> Result<()> {
        let OpSite { key, g, .. } = site;
        let arg = |i: usize| site.arg(i);
        let (a, a_stride) = self.loc(key, arg(0))?;
        let (b, b_stride) = self.loc(key, arg(1))?;
        let gemm = GradientGemm {
            matrix: m,
            rows: hi - lo,
            a: a + lo * a_stride,
            a_stride,
            b: b + lo * b_stride,
            b_stride,
        };
        if !self.grads_in_registers {
            self.gemms.push(gemm);
            return Ok(());
        }
        let mut deps = Vec::new();
        self.deps_of(key, arg(0), lo, hi, &mut deps);
        self.deps_of(key, arg(1), lo, hi, &mut deps);
        let spec = &self.prog.matrices[usize::from(m)];
        if hi - lo >= self.host_items && a_stride >= spec.rows && b_stride >= spec.cols {
            self.host_task(HostWork::Gradient(gemm), deps)?;
            return Ok(());
        }
        let mut ops = Vec::with_capacity(PRODUCT_ITEM_WORDS * (hi - lo));
        let (dys, xs) = (self.rows_of(key, arg(0))?, self.rows_of(key, arg(1))?);
        for i in lo..hi {
            ops.extend([dys.row(i)?, xs.row(i)?, NO_INDEX]);
        }
        let load = (hi - lo) * g.nodes[arg(0)].ty.width() * g.nodes[arg(1)].ty.width();
        let holders = Placement::Holders { matrix: m };
        self.push(OP_OUTER, m, ops, deps, load, holders)?;
        Ok(())
    }

    /// Column copies (`concat`, `slice`, `reshape`, `pad`): each source into its window of the output.
    fn column_copy_op(&mut self, site: OpSite<'a>, op: &Op) -> Result<()> {
        let OpSite {
            key,
            n,
            g,
            node,
            width,
            lo,
            hi,
            ..
        } = site;
        let arg = |i: usize| site.arg(i);
        // column copies: each source into its window of the output
        let parts: Vec<(NodeId, usize, usize, usize)> = match op {
            Op::Slice(sl) => vec![(arg(0), sl.start, 0, sl.len)],
            Op::Pad(pad) => vec![(arg(0), 0, pad.start, g.nodes[arg(0)].ty.width())],
            Op::Reshape(_) => vec![(arg(0), 0, 0, width)],
            _ => {
                let mut at = 0;
                node.inputs
                    .iter()
                    .map(|&x| {
                        let w = g.nodes[x].ty.width();
                        at += w;
                        (x, 0, at - w, w)
                    })
                    .collect()
            }
        };
        for (a, b) in self.chunks(lo, hi, width) {
            for &(x, src_col, dst_col, w) in &parts {
                let (sbase, sstride) = self.loc(key, x)?;
                let (dbase, dstride) = self.loc(key, n)?;
                let mut deps = Vec::new();
                self.deps_of(key, x, a, b, &mut deps);
                let flags = if matches!(op, Op::Pad(_)) {
                    ROWS_ACCUMULATE
                } else {
                    0
                };
                let t = self.rows_task(
                    RowCopy {
                        flags,
                        rows: b - a,
                        width: w,
                        dst: (
                            u32_of(dbase + a * dstride + dst_col, "offset")?,
                            dstride,
                            NO_INDEX,
                        ),
                        src: (
                            u32_of(sbase + a * sstride + src_col, "offset")?,
                            sstride,
                            NO_INDEX,
                        ),
                    },
                    deps,
                )?;
                self.record(key, n, a, b, t);
            }
        }
        Ok(())
    }

    /// A child-sum's tasks (unless the children add into it as they gather).
    fn sum_children_op(&mut self, site: OpSite<'a>) -> Result<()> {
        let OpSite {
            key,
            n,
            width,
            lo,
            hi,
            ..
        } = site;
        if self.prog.pushed_sum(key, n).is_some() {
            // the children add into it as they gather (see `gathers`)
            return Ok(());
        }
        let f = site.function("sum_children")?;
        let (sbase, sstride) = self.loc(key, site.arg(0))?;
        for (a, b) in self.chunks(lo, hi, width) {
            let mut deps = Vec::new();
            let (ea, eb) = self.span(key, Space::Vertex, Space::Edge, a, b);
            self.deps_of(key, site.arg(0), ea, eb, &mut deps);
            let ops = vec![
                u32_of(b - a, "rows")?,
                u32_of(width, "width")?,
                self.row_at(key, n, a)?,
                u32_of(sbase, "offset")?,
                u32_of(sstride, "stride")?,
                self.up(self.functions[f].edge_offsets + a)?,
            ];
            let t = self.push_any(OP_SUM_CHILDREN, 0, ops, deps, (eb - ea) * width)?;
            self.record(key, n, a, b, t);
        }
        Ok(())
    }

    /// Vertex rows copied to their child edges.
    fn expand_children_op(&mut self, site: OpSite<'a>) -> Result<()> {
        let OpSite {
            key,
            n,
            width,
            lo,
            hi,
            ..
        } = site;
        let f = site.function("expand_children")?;
        let (sbase, sstride) = self.loc(key, site.arg(0))?;
        for (a, b) in self.chunks(lo, hi, width) {
            let mut deps = Vec::new();
            let (va, vb) = self.span(key, Space::Edge, Space::Vertex, a, b);
            self.deps_of(key, site.arg(0), va, vb, &mut deps);
            let (dbase, _) = self.loc(key, n)?;
            let t = self.rows_task(
                RowCopy {
                    flags: 0,
                    rows: b - a,
                    width,
                    dst: (u32_of(dbase + a * width, "offset")?, width, NO_INDEX),
                    src: (
                        u32_of(sbase, "offset")?,
                        sstride,
                        self.up(self.functions[f].edge_parent + a)?,
                    ),
                },
                deps,
            )?;
            self.record(key, n, a, b, t);
        }
        Ok(())
    }

    /// A sum (or mean) over rows.
    fn sum_rows_op(&mut self, site: OpSite<'a>, sr: SumRows) -> Result<()> {
        let OpSite {
            key,
            n,
            g,
            width,
            r,
            ..
        } = site;
        let x = site.arg(0);
        let x_space = g.nodes[x].ty.space;
        let total = self.rows(key, x_space);
        let (xlo, xhi) = Self::space_range(x_space, r);
        let scale: f32 = if sr.mean && total > 0 {
            1.0 / total as f32
        } else {
            1.0
        };
        let direct = self.direct_grad(key, n);
        let dst = match direct {
            Some(p) => self.prog.params.grad[p].ok_or_else(|| err("no gradient slot"))?,
            None => self.loc(key, n)?.0,
        };
        let (sbase, sstride) = self.loc(key, x)?;
        for (a, b) in self.chunks(xlo, xhi, width) {
            let mut deps = Vec::new();
            self.deps_of(key, x, a, b, &mut deps);
            let ops = vec![
                u32_of(b - a, "rows")?,
                u32_of(width, "width")?,
                u32_of(dst, "offset")?,
                u32_of(sbase + a * sstride, "offset")?,
                u32_of(sstride, "stride")?,
                scale.to_bits(),
            ];
            let t = self.push_any(OP_SUM_ROWS, ROWS_ACCUMULATE, ops, deps, (b - a) * width)?;
            if direct.is_none() {
                self.record(key, n, 0, 1, t);
            }
        }
        Ok(())
    }

    /// A static row broadcast over rows.
    fn broadcast_rows_op(&mut self, site: OpSite<'a>, br: BroadcastRows) -> Result<()> {
        let OpSite {
            key,
            n,
            out_space,
            width,
            lo,
            hi,
            ..
        } = site;
        let arg = |i: usize| site.arg(i);
        let total = self.rows(key, out_space);
        let scale: f32 = if br.mean && total > 0 {
            1.0 / total as f32
        } else {
            1.0
        };
        for (a, b) in self.chunks(lo, hi, width) {
            let mut deps = Vec::new();
            self.deps_of(key, arg(0), 0, 1, &mut deps);
            let ops = vec![
                u32_of(b - a, "rows")?,
                u32_of(width, "width")?,
                self.row_at(key, n, a)?,
                self.row_at(key, arg(0), 0)?,
                scale.to_bits(),
            ];
            let t = self.push_any(OP_BROADCAST_ROWS, 0, ops, deps, (b - a) * width)?;
            self.record(key, n, a, b, t);
        }
        Ok(())
    }

    /// Table rows looked up by the vertex tokens.
    fn embedding_op(&mut self, site: OpSite<'a>) -> Result<()> {
        let OpSite {
            key,
            n,
            width,
            lo,
            hi,
            ..
        } = site;
        let f = site.function("embedding")?;
        let tokens = self.functions[f]
            .tokens
            .ok_or_else(|| err("embedding without tokens"))?;
        let table = self.row_at(key, site.arg(0), 0)?;
        for (a, b) in self.chunks(lo, hi, width) {
            let (dbase, _) = self.loc(key, n)?;
            let t = self.rows_task(
                RowCopy {
                    flags: 0,
                    rows: b - a,
                    width,
                    dst: (u32_of(dbase + a * width, "offset")?, width, NO_INDEX),
                    src: (table, width, self.up(tokens + a)?),
                },
                Vec::new(),
            )?;
            self.record(key, n, a, b, t);
        }
        Ok(())
    }

    /// Softmax cross-entropy (`xent`) or its gradient.
    fn xent_op(&mut self, site: OpSite<'a>, xent: bool) -> Result<()> {
        let OpSite {
            key, n, g, lo, hi, ..
        } = site;
        let arg = |i: usize| site.arg(i);
        let labels = self
            .labels_at
            .ok_or_else(|| err("softmax_xent without labels"))?;
        let classes = g.nodes[arg(0)].ty.width();
        for (a, b) in self.chunks(lo, hi, classes) {
            let mut deps = Vec::new();
            self.deps_of(key, arg(0), a, b, &mut deps);
            let mut ops = vec![
                u32_of(b - a, "rows")?,
                u32_of(classes, "classes")?,
                self.row_at(key, n, a)?,
                self.row_at(key, arg(0), a)?,
                self.up(labels + a)?,
            ];
            if !xent {
                self.deps_of(key, arg(2), a, b, &mut deps);
                ops.push(self.row_at(key, arg(2), a)?);
            }
            let t = self.push_any(OP_XENT, u16::from(!xent), ops, deps, (b - a) * classes)?;
            self.record(key, n, a, b, t);
        }
        Ok(())
    }
}
