//! Lowering of one batch to the persistent kernel's task DAG (VPPS §III-B1):
//! every step of every vertex function's `F` for every batching task, the
//! head, the head's and the functions' `∂F` in reverse, the weight-gradient
//! products and the optimizer update — each an instruction over a chunk of
//! rows (or, for a product with a register-cached weight, one vector) with
//! its dependencies, for the scheduler to level, balance and encode.
//!
//! # The batch's memory (float offsets in the one pool)
//!
//! After the parameter region ([`ParamLayout`]) come three regions:
//! *zeroed* (zero-filled before the launch: everything accumulated with
//! atomics — transposed products, forward products (whose reduction a wide
//! instruction may split), state and pushed-value gradients, sums over
//! rows, the loss), *plain* (every other value: one buffer per graph
//! node covering all rows of its function, as Cavs' dynamic tensors) and
//! *upload* (what the host provides: dropout masks, the loss seed and the
//! index arrays instructions read — tokens, labels, child offsets, parent
//! rows, and the absolute offsets of gathered, pushed and scattered rows).
//!
//! Values cross vertex functions by absolute row offsets, so no state
//! buffer is copied: a gather reads its children's scattered rows where
//! their function stored them, and a child-gradient scatter adds straight
//! into the children's state-gradient rows.
//!
//! # Dependencies
//!
//! Every task records, per node and row, that it produced those rows; a
//! task depends on the producers of every row it reads. The optimizer
//! update depends on one sink task that depends on everything, so it runs
//! after the whole batch (nothing still reads a parameter it changes).

use std::collections::HashMap;

use rand_chacha::ChaCha8Rng;

use ramus_core::graph::{DType, Graph, NodeId, NodeKind, Role, Source, Space};
use ramus_core::ops::Op;
use ramus_core::vpps::{Placement, VppTask, VppTaskGraph};
use ramus_core::Model;
use ramus_exec::fill_dropout_mask;
use ramus_graph::Schedule;

use super::program::{graph_keys, GraphKey, ParamLayout, PersistentProgram};
use crate::error::{CudaError, Result};

mod fused;
mod index;
mod ops;
mod tasks;

/// Elements an instruction over rows covers at least, where it has the
/// rows (one per thread of a CTA).
const MIN_CHUNK_ELEMENTS: usize = 256;

/// A node's rows in the pool: row `i` starts at `base + i · stride`.
#[derive(Clone, Copy)]
struct RowLocator {
    base: usize,
    stride: usize,
}

impl RowLocator {
    fn row(self, i: usize) -> Result<u32> {
        u32_of(self.base + i * self.stride, "offset")
    }
}

/// One batch lowered: the task DAG and the memory the kernel needs.
pub(crate) struct BatchProgram {
    pub graph: VppTaskGraph,
    /// Pool floats to zero before the launch.
    pub zeroed: std::ops::Range<usize>,
    /// Where `upload` goes in the pool.
    pub upload_at: usize,
    /// Host-provided words (floats as bits, and indices).
    pub upload: Vec<u32>,
    /// The loss (one float), if the head has one.
    pub loss_at: usize,
    /// The word (zeroed) an update sets when a value goes non-finite.
    pub fault_at: usize,
    /// First pool float after the batch's regions.
    pub end: usize,
    /// Weight-gradient products left to cuBLAS when the gradients are not
    /// in registers, and the update tasks of the cached matrices that run
    /// after them (a second launch).
    pub gemms: Vec<GradientGemm>,
    pub matrix_updates: VppTaskGraph,
    /// The work of the graph's host tasks ([`OP_HOST`], whose first
    /// operand indexes this): products too wide for the kernel's own tiles.
    pub host_work: Vec<HostWork>,
}

/// Work the host enqueues between two launches of the kernel (see
/// [`ramus_core::vpps::launches`]): a level's product with at least
/// `host_items` items as one cuBLAS GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HostWork {
    /// `y += x Wᵀ` (`transposed`: `y += x W`) for `rows` rows of `x` at
    /// `input` and of `y` at `output` (row strides given; `y` starts zeroed,
    /// or holds the bias).
    Product {
        matrix: u16,
        transposed: bool,
        rows: usize,
        input: usize,
        input_stride: usize,
        output: usize,
        output_stride: usize,
    },
    /// A weight-gradient product into the matrix's accumulator.
    Gradient(GradientGemm),
}

/// `grad[m] += Aᵀ B` for a cached matrix `m` whose gradient is not in
/// registers: `rows` rows of `A` (the output gradient, `rows_m` wide) at
/// `a` with row stride `a_stride`, and of `B` (the input) at `b`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GradientGemm {
    pub matrix: u16,
    pub rows: usize,
    pub a: usize,
    pub a_stride: usize,
    pub b: usize,
    pub b_stride: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Region {
    Zeroed,
    Plain,
    Upload,
}

fn err(message: impl Into<String>) -> CudaError {
    CudaError::Model(format!("persistent engine: {}", message.into()))
}

fn u32_of(v: usize, what: &str) -> Result<u32> {
    u32::try_from(v).map_err(|_| {
        err(format!(
            "{what} = {v} does not fit 32 bits (pool too large)"
        ))
    })
}

/// A row copy ([`OP_ROWS`](ramus_core::vpps::isa::OP_ROWS)): `rows` rows of `width` floats from `src` to
/// `dst` (`flags`: accumulate, absolute rows; see the instruction), each
/// side as (pool offset of its row 0, row stride, upload offset of its row
/// index or [`NO_INDEX`](ramus_core::vpps::isa::NO_INDEX)).
struct RowCopy {
    flags: u16,
    rows: usize,
    width: usize,
    dst: (u32, usize, u32),
    src: (u32, usize, u32),
}

/// Index arrays of one vertex function (offsets into the upload region).
#[derive(Clone, Debug, Default)]
struct FunctionIndex {
    tokens: Option<usize>,
    edge_offsets: usize,
    edge_parent: usize,
    gather_all_src: Option<usize>,
    gather_src: HashMap<usize, usize>,
    child_grad_all_dst: Option<usize>,
    child_grad_dst: HashMap<usize, usize>,
}

/// How a gather or child-gradient scatter reaches children: one row per
/// child edge (`gather_all`), or one row per vertex for child `k`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ChildLink {
    Edges,
    Child(usize),
}

impl ChildLink {
    /// The task rows (edges or vertices) of task range `r`.
    fn range(self, r: [usize; 4]) -> (usize, usize) {
        match self {
            ChildLink::Edges => (r[2], r[3]),
            ChildLink::Child(_) => (r[0], r[1]),
        }
    }

    /// The child vertex of row `i`, if any.
    fn child(self, rows: &ramus_graph::FunctionRows, i: usize) -> Option<u32> {
        match self {
            ChildLink::Edges => Some(rows.edge_child[i]),
            ChildLink::Child(k) => rows.child(i, k),
        }
    }
}

/// The tasks that wrote each row of one node: most rows have one or two
/// writers (a value, or a value and an in-place concat / a gradient row
/// with two parents) kept in flat arrays; further writers (sums over rows
/// written by every chunk) go to per-row lists, allocated only for a node
/// that has any.
#[derive(Clone, Debug, Default)]
struct RowProducers {
    first: Vec<u32>,
    second: Vec<u32>,
    more: Vec<Vec<u32>>,
}

impl RowProducers {
    const NONE: u32 = u32::MAX;

    fn new(rows: usize) -> Self {
        RowProducers {
            first: vec![Self::NONE; rows],
            second: vec![Self::NONE; rows],
            more: Vec::new(),
        }
    }

    fn record(&mut self, lo: usize, hi: usize, task: u32) {
        let hi = hi.min(self.first.len());
        for row in lo..hi {
            if self.first[row] == Self::NONE {
                self.first[row] = task;
            } else if self.second[row] == Self::NONE {
                self.second[row] = task;
            } else {
                if self.more.is_empty() {
                    self.more = vec![Vec::new(); self.first.len()];
                }
                self.more[row].push(task);
            }
        }
    }

    /// Appends the producers of rows `lo..hi` to `out`; a task that wrote
    /// a run of these rows is appended once per run, not once per row
    /// (callers sort and deduplicate what is left).
    fn collect(&self, lo: usize, hi: usize, out: &mut Vec<u32>) {
        let hi = hi.min(self.first.len());
        let lo = lo.min(hi);
        for column in [&self.first[lo..hi], &self.second[lo..hi]] {
            let mut last = Self::NONE;
            for &task in column {
                if task != last && task != Self::NONE {
                    out.push(task);
                }
                last = task;
            }
        }
        if !self.more.is_empty() {
            for row in &self.more[lo..hi] {
                out.extend_from_slice(row);
            }
        }
    }
}

struct Unroller<'a> {
    /// Weight gradients accumulate in registers (else: cuBLAS afterwards).
    grads_in_registers: bool,
    /// No update tasks: see [`Lowering::defer_updates`].
    defer_updates: bool,
    /// Instructions one op's rows are cut into at most (see
    /// [`Unroller::chunks`]).
    spread: usize,
    gemms: Vec<GradientGemm>,
    /// Items from which a product is host work (see [`HostWork`]).
    host_items: usize,
    host_work: Vec<HostWork>,
    model: &'a Model,
    prog: &'a PersistentProgram,
    s: &'a Schedule,
    head_vertices: Vec<u32>,
    /// Per graph (by [`GraphKey::index`]): the buffer of each node.
    bufs: Vec<Vec<Option<(Region, usize)>>>,
    sizes: [usize; 3],
    bases: [usize; 3],
    upload: Vec<u32>,
    functions: Vec<FunctionIndex>,
    labels_at: Option<usize>,
    push_src_at: usize,
    head_grad_dst_at: usize,
    update_rows: HashMap<usize, (usize, usize)>,
    /// The batch's non-finite fault word (see [`BatchProgram::fault_at`]).
    fault: (Region, usize),
    /// Producers per graph (by index) and node, per row (allocated at
    /// first use).
    prod: Vec<Vec<RowProducers>>,
    /// Per graph (by index) and node, its [`Unroller::loc`] once the
    /// regions' bases are known (`None`: none, or not yet filled).
    locs: Vec<Vec<Option<(usize, usize)>>>,
    g: VppTaskGraph,
}

fn region_index(r: Region) -> usize {
    match r {
        Region::Zeroed => 0,
        Region::Plain => 1,
        Region::Upload => 2,
    }
}

impl<'a> Unroller<'a> {
    fn graph(&self, key: GraphKey) -> &'a Graph {
        key.graph(self.model)
    }

    /// Rows of `space` in graph `key`.
    fn rows(&self, key: GraphKey, space: Space) -> usize {
        space_rows(self.s, self.head_vertices.len(), key, space)
    }

    fn alloc(&mut self, region: Region, len: usize) -> (Region, usize) {
        let i = region_index(region);
        let at = self.sizes[i];
        self.sizes[i] += len.max(1);
        (region, at)
    }

    fn alloc_upload(&mut self, words: &[u32]) -> usize {
        let at = self.upload.len();
        self.upload.extend_from_slice(words);
        self.sizes[2] = self.upload.len();
        at
    }

    fn abs(&self, (region, at): (Region, usize)) -> usize {
        self.bases[region_index(region)] + at
    }

    /// Pool offset of row 0 of node `n` (view windows included) and its
    /// row stride.
    fn loc(&self, key: GraphKey, n: NodeId) -> Result<(usize, usize)> {
        match self
            .locs
            .get(key.index(self.prog.functions))
            .and_then(|l| l.get(n))
        {
            Some(&Some(at)) => Ok(at),
            _ => self.find_loc(key, n),
        }
    }

    /// Every node's [`Self::loc`] where it has one, once the regions' bases
    /// are known (a batch's lowering asks for them per instruction).
    fn fill_locs(&mut self) {
        let mut locs = vec![Vec::new(); GraphKey::table_len(self.prog.functions)];
        for key in graph_keys(self.model) {
            locs[key.index(self.prog.functions)] = (0..self.graph(key).nodes.len())
                .map(|n| self.find_loc(key, n).ok())
                .collect();
        }
        self.locs = locs;
    }

    /// [`Self::loc`] worked out: through forward inputs and views to the
    /// node's buffer or parameter.
    fn find_loc(&self, key: GraphKey, n: NodeId) -> Result<(usize, usize)> {
        let g = self.graph(key);
        if let NodeKind::Input(Source::Forward(m)) = g.nodes[n].kind {
            if let Some(fk) = key.forward_of() {
                return self.find_loc(fk, m);
            }
        }
        if let Some(v) = self.prog.view(key, n) {
            let (base, _) = self.find_loc(key, v.source)?;
            return Ok((base + v.offset, v.stride));
        }
        let width = g.nodes[n].ty.width();
        if let NodeKind::Param(p) = g.nodes[n].kind {
            return Ok((self.prog.params.value[p], width));
        }
        match self.bufs[key.index(self.prog.functions)][n] {
            Some(b) => Ok((self.abs(b), width)),
            None => Err(err(format!(
                "node %{n} of {key:?} ({}) has no buffer",
                g.nodes[n].ty
            ))),
        }
    }

    fn row_at(&self, key: GraphKey, n: NodeId, row: usize) -> Result<u32> {
        self.rows_of(key, n)?.row(row)
    }

    /// Where the rows of node `n` of graph `key` are (for loops over many
    /// rows: [`Self::loc`] once, not per row).
    fn rows_of(&self, key: GraphKey, n: NodeId) -> Result<RowLocator> {
        let (base, stride) = self.loc(key, n)?;
        Ok(RowLocator { base, stride })
    }

    /// The rows of `to` that rows `lo..hi` of `from` read in graph `key`.
    fn span(&self, key: GraphKey, from: Space, to: Space, lo: usize, hi: usize) -> (usize, usize) {
        if to == Space::Static {
            return (0, 1);
        }
        if from == to {
            return (lo, hi);
        }
        let Some(f) = key.function() else {
            return (lo, hi);
        };
        let rows = &self.s.functions[f];
        match (from, to) {
            (Space::Vertex, Space::Edge) => (
                rows.edge_offsets[lo] as usize,
                rows.edge_offsets[hi] as usize,
            ),
            (Space::Edge, Space::Vertex) if hi > lo => (
                rows.edge_parent[lo] as usize,
                rows.edge_parent[hi - 1] as usize + 1,
            ),
            _ => (0, self.rows(key, to)),
        }
    }

    fn producers(&mut self, key: GraphKey, n: NodeId) -> &mut RowProducers {
        let (key, n) = self.prog.stored(key, n);
        let functions = self.prog.functions;
        if self.prod[key.index(functions)][n].first.is_empty() {
            let rows = self.rows(key, self.graph(key).nodes[n].ty.space);
            self.prod[key.index(functions)][n] = RowProducers::new(rows.max(1));
        }
        &mut self.prod[key.index(functions)][n]
    }

    fn deps_of(&mut self, key: GraphKey, n: NodeId, lo: usize, hi: usize, out: &mut Vec<u32>) {
        self.producers(key, n).collect(lo, hi, out);
    }

    fn record(&mut self, key: GraphKey, n: NodeId, lo: usize, hi: usize, task: u32) {
        self.producers(key, n).record(lo, hi, task);
    }

    fn push(
        &mut self,
        op: u8,
        arg: u16,
        operands: Vec<u32>,
        mut deps: Vec<u32>,
        load: usize,
        placement: Placement,
    ) -> Result<u32> {
        deps.sort_unstable();
        deps.dedup();
        self.g
            .push(VppTask {
                op,
                arg,
                operands,
                deps,
                load: load.max(1) as u64,
                placement,
            })
            .map_err(CudaError::from)
    }

    /// [`Self::push`] for any processor ([`Placement::Any`]).
    fn push_any(
        &mut self,
        op: u8,
        arg: u16,
        operands: Vec<u32>,
        deps: Vec<u32>,
        load: usize,
    ) -> Result<u32> {
        self.push(op, arg, operands, deps, load, Placement::Any)
    }

    // ------------------------------------------------------------ pass 1

    /// Allocates every node buffer and index array.
    fn allocate(&mut self) -> Result<()> {
        for key in graph_keys(self.model) {
            let g = self.graph(key);
            let mut bufs = vec![None; g.nodes.len()];
            for (n, node) in g.nodes.iter().enumerate() {
                if let Some(region) = node_region(self.model, self.prog, key, n)? {
                    let len = self.rows(key, node.ty.space) * node.ty.width();
                    bufs[n] = Some(self.alloc(region, len));
                }
            }
            self.prod[key.index(self.prog.functions)] = vec![RowProducers::default(); bufs.len()];
            self.bufs[key.index(self.prog.functions)] = bufs;
        }
        self.fault = self.alloc(Region::Zeroed, 1);
        // upload placeholders for buffers the host fills
        self.upload = vec![0; self.sizes[2]];
        Ok(())
    }

    /// The floats the host fills in the upload region: the loss seed, then
    /// the dropout masks (drawn from `rng`) in the CPU engine's order
    /// (functions' forward graphs, then the head).
    fn host_floats(&mut self, rng: &mut ChaCha8Rng) -> Result<()> {
        let model = self.model;
        let seed_key = GraphKey::HeadBackward;
        if let Some(i) = model
            .head
            .forward
            .outputs
            .iter()
            .position(|o| o.role == Role::Loss)
        {
            if let Some(n) = model.head.backward.input_node(Source::OutputGrad(i)) {
                let (_, at) = self.bufs[seed_key.index(self.prog.functions)][n]
                    .ok_or_else(|| err("no loss seed buffer"))?;
                self.upload[at] = 1f32.to_bits();
            }
        }
        for (key, n, rate) in dropout_masks(model) {
            let ty = &key.graph(model).nodes[n].ty;
            let len = self.rows(key, ty.space) * ty.width();
            let (_, at) = self.bufs[key.index(self.prog.functions)][n]
                .ok_or_else(|| err("no mask buffer"))?;
            let mut mask = vec![0f32; len];
            fill_dropout_mask(&mut mask, rate, true, rng);
            for (d, m) in self.upload[at..at + len].iter_mut().zip(mask) {
                *d = m.to_bits();
            }
        }
        Ok(())
    }

    /// `Some(matrix)` if `n` is a cached matrix's gradient product `dyᵀ x`.
    fn outer_product(&self, key: GraphKey, n: NodeId) -> Result<Option<u16>> {
        outer_product(self.model, self.prog, key, n)
    }
}

/// The region node `n` of graph `key` has a buffer in, or `None` (a
/// parameter, an input read where it lives, a view, a value not
/// materialized, or a product whose outer sum stays in the gradient
/// registers). Its buffer holds its space's rows of its width (at least
/// one float): the batch's layout, which [`unroll_batch`] allocates and
/// [`super::memory`] counts.
pub(crate) fn node_region(
    model: &Model,
    prog: &PersistentProgram,
    key: GraphKey,
    n: NodeId,
) -> Result<Option<Region>> {
    let node = &key.graph(model).nodes[n];
    let plan = prog.plan(key);
    Ok(match node.kind {
        NodeKind::Param(_) => None,
        NodeKind::Input(src) => match src {
            Source::Forward(_) | Source::Token | Source::Label => None,
            Source::Gather(_) | Source::GatherAll | Source::HeadInput => Some(Region::Plain),
            Source::DropoutMask { .. } => Some(Region::Upload),
            Source::OutputGrad(_) => Some(match key {
                GraphKey::HeadBackward => Region::Upload,
                _ => Region::Zeroed,
            }),
            Source::Pull => {
                return Err(err(
                    "pulled inputs (features) are not supported yet".to_string()
                ))
            }
        },
        NodeKind::Op(_) if !plan.materialized[n] || plan.views.contains_key(&n) => None,
        NodeKind::Op(_) if node.ty.dtype == DType::Index => {
            return Err(err(format!(
                "op %{n} of {key:?} computes indices, which the kernel cannot"
            )))
        }
        NodeKind::Op(_) if outer_product(model, prog, key, n)?.is_some() => None,
        NodeKind::Op(_) if accumulated(model, prog, key, n) => Some(Region::Zeroed),
        NodeKind::Op(_) => Some(Region::Plain),
    })
}

/// True for nodes written with atomics (they must start at zero).
fn accumulated(model: &Model, prog: &PersistentProgram, key: GraphKey, n: NodeId) -> bool {
    let node = &key.graph(model).nodes[n];
    matches!(node.op(), Some(Op::SumRows(_) | Op::Pad(_)))
        || prog.pushed_sum(key, n).is_some()
        || transposed_product(model, prog, key, n).is_some()
        || prog.forward_product_output(key, n)
}

/// `Some(matrix)` if `n` is `dy W` with `W` a register-cached matrix.
fn transposed_product(
    model: &Model,
    prog: &PersistentProgram,
    key: GraphKey,
    n: NodeId,
) -> Option<u16> {
    let g = key.graph(model);
    let Some(Op::MatMul(mm)) = g.nodes[n].op() else {
        return None;
    };
    let NodeKind::Param(p) = g.nodes[*g.nodes[n].inputs.get(1)?].kind else {
        return None;
    };
    (!mm.trans_a && !mm.trans_b)
        .then_some(prog.cached[p])
        .flatten()
}

/// `Some(matrix)` if `n` is a cached matrix's gradient product `dyᵀ x`.
fn outer_product(
    model: &Model,
    prog: &PersistentProgram,
    key: GraphKey,
    n: NodeId,
) -> Result<Option<u16>> {
    let g = key.graph(model);
    let Some(Op::MatMul(mm)) = g.nodes[n].op() else {
        return Ok(None);
    };
    if !mm.trans_a {
        return Ok(None);
    }
    let param = g.outputs.iter().find_map(|o| match o.role {
        Role::ParamGrad(p) if o.node == n => Some(p),
        _ => None,
    });
    match param.and_then(|p| prog.cached[p]) {
        Some(m) => Ok(Some(m)),
        None => Err(err(format!(
            "product %{n} of {key:?} (Aᵀ B) is not a register-cached weight's gradient"
        ))),
    }
}

/// Rows of `space` in graph `key` of batch `s` with `head_rows` head
/// vertices.
pub(crate) fn space_rows(s: &Schedule, head_rows: usize, key: GraphKey, space: Space) -> usize {
    match (key.function(), space) {
        (_, Space::Static) => 1,
        (Some(f), Space::Vertex) => s.functions[f].rows(),
        (Some(f), Space::Edge) => s.functions[f].edges(),
        (None, Space::Vertex) => head_rows,
        (None, Space::Edge) => 0,
    }
}

/// The dropout-mask elements [`unroll_batch`] draws for batch `s` (one
/// `f64` from the stream each), so a batch prepared ahead can start its
/// masks where the batches before it leave the stream.
pub(crate) fn dropout_draws(model: &Model, s: &Schedule) -> u128 {
    if dropout_masks(model).next().is_none() {
        return 0;
    }
    let head_rows = crate::engine::head_vertices(model.head.rows, s).len();
    dropout_masks(model)
        .map(|(key, n, _)| {
            let ty = &key.graph(model).nodes[n].ty;
            (space_rows(s, head_rows, key, ty.space) * ty.width()) as u128
        })
        .sum()
}

/// Every dropout mask of `model` with its rate, in the order the CPU
/// engine draws them: the functions' forward graphs, then the head's.
fn dropout_masks(model: &Model) -> impl Iterator<Item = (GraphKey, NodeId, u16)> + '_ {
    (0..model.functions.len())
        .map(GraphKey::Forward)
        .chain([GraphKey::HeadForward])
        .flat_map(move |key| {
            key.graph(model)
                .nodes
                .iter()
                .enumerate()
                .filter_map(move |(n, node)| match node.kind {
                    NodeKind::Input(Source::DropoutMask { rate, .. }) => Some((key, n, rate)),
                    _ => None,
                })
        })
}

/// Lowers one training batch (see the module docs) for `spread` processors
/// (the cut of rows into instructions). `rng` draws the dropout masks in
/// the CPU engine's order.
pub(crate) fn unroll_batch(
    model: &Model,
    prog: &PersistentProgram,
    s: &Schedule,
    grads_in_registers: bool,
    spread: usize,
    host_items: usize,
    rng: &mut ChaCha8Rng,
) -> Result<BatchProgram> {
    let lowering = Lowering {
        grads_in_registers,
        defer_updates: false,
    };
    unroll(model, prog, s, lowering, spread, host_items, rng)
}

/// Where a batch's weight gradients build up and whether its program
/// applies them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Lowering {
    /// The cached matrices' gradients in the kernel's registers.
    pub grads_in_registers: bool,
    /// The program ends with every gradient in its pool slot and applies no
    /// update (data parallelism: the gradients are summed over the ranks
    /// first, then updated outside the kernel).
    pub defer_updates: bool,
}

/// [`unroll_batch`] with the updates deferred or not.
pub(crate) fn unroll(
    model: &Model,
    prog: &PersistentProgram,
    s: &Schedule,
    lowering: Lowering,
    spread: usize,
    host_items: usize,
    rng: &mut ChaCha8Rng,
) -> Result<BatchProgram> {
    let grads_in_registers = lowering.grads_in_registers;
    let head_vertices = crate::engine::head_vertices(model.head.rows, s);
    if head_vertices.is_empty() {
        return Err(err(
            "the batch has no vertex for the head (no labelled vertex)",
        ));
    }
    let mut u = Unroller {
        grads_in_registers,
        defer_updates: lowering.defer_updates,
        spread,
        gemms: Vec::new(),
        host_items,
        host_work: Vec::new(),
        model,
        prog,
        s,
        head_vertices,
        bufs: vec![Vec::new(); GraphKey::table_len(prog.functions)],
        sizes: [0; 3],
        bases: [0; 3],
        upload: Vec::new(),
        functions: Vec::new(),
        labels_at: None,
        push_src_at: 0,
        head_grad_dst_at: 0,
        update_rows: HashMap::new(),
        fault: (Region::Zeroed, 0),
        prod: vec![Vec::new(); GraphKey::table_len(prog.functions)],
        locs: Vec::new(),
        g: VppTaskGraph::new(),
    };
    u.allocate()?;
    // index arrays go after the buffers the host fills; their contents
    // need the regions' bases, which need their sizes: size them first
    let params: &ParamLayout = &prog.params;
    u.bases = [
        params.total,
        params.total + u.sizes[0],
        params.total + u.sizes[0] + u.sizes[1],
    ];
    u.fill_locs();
    u.index_arrays()?;
    u.host_floats(rng)?;
    u.tasks()?;
    let loss_at = match model
        .head
        .forward
        .outputs
        .iter()
        .find(|o| o.role == Role::Loss)
    {
        Some(o) => u.loc(GraphKey::HeadForward, o.node)?.0,
        None => return Err(err("the head has no loss")),
    };
    // without register gradients: the cached matrices' updates, after the
    // cuBLAS products (a second launch of the kernel)
    let mut batch_graph = std::mem::take(&mut u.g);
    if !grads_in_registers && !lowering.defer_updates {
        for m in &prog.matrices {
            u.dense_update(m.param, &model.params[m.param].shape, Vec::new())?;
        }
    }
    let matrix_updates = std::mem::replace(&mut u.g, VppTaskGraph::new());
    std::mem::swap(&mut batch_graph, &mut u.g);
    let zeroed = u.bases[0]..u.bases[0] + u.sizes[0];
    let fault_at = u.abs(u.fault);
    let upload_at = u.bases[2];
    let end = upload_at + u.upload.len();
    Ok(BatchProgram {
        gemms: u.gemms,
        host_work: u.host_work,
        matrix_updates,
        graph: u.g,
        zeroed,
        upload_at,
        upload: u.upload,
        loss_at,
        fault_at,
        end,
    })
}

/// Whether the persistent kernel runs `op` as a step of its own: the arms
/// of `Unroller::op` (elementwise ops run inside fused groups). `Err`
/// names what is missing.
pub(super) fn instruction_support(op: &Op) -> std::result::Result<(), &'static str> {
    match op {
        Op::MatMul(_)
        | Op::Concat(_)
        | Op::Slice(_)
        | Op::Reshape(_)
        | Op::Pad(_)
        | Op::SumChildren(_)
        | Op::ExpandChildren(_)
        | Op::SumRows(_)
        | Op::BroadcastRows(_)
        | Op::Embedding(_)
        | Op::SoftmaxXent(_)
        | Op::SoftmaxXentBackward(_)
        | ramus_core::elementwise_op!() => Ok(()),
        Op::RowMatMul(_) | Op::EmbeddingUnk(_) | Op::EmbeddingUnkBackward(_) => {
            Err("has no persistent-kernel instruction")
        }
        ramus_core::image_op!() => Err("has no persistent-kernel instruction (an image op)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ramus_core::vpps::isa::{
        OP_MATVEC, OP_MATVEC_T, OP_NOP, OP_ROWS, OP_UPDATE, PRODUCT_ITEM_WORDS, ROWS_ACCUMULATE,
        ROWS_DST_ABSOLUTE,
    };
    use ramus_core::vpps::{plan, simulate, DeviceLimits, PlanRequest, Scheduler};
    use ramus_graph::binarize::{binarize, Side};
    use ramus_graph::random::{random_chain, random_path, random_tree};
    use ramus_graph::{BatchingPolicy, InputGraph};
    use ramus_nn::{build_model_with, ModelConfig, ModelOptions};
    use rand::SeedableRng;

    fn lowered(name: &str, graphs: &[InputGraph], dropout: f64) -> (VppTaskGraph, usize) {
        lowered_on(name, graphs, dropout, 20, 6)
    }

    /// [`lowered`] with `hidden` units on `vpps` processors.
    fn lowered_on(
        name: &str,
        graphs: &[InputGraph],
        dropout: f64,
        hidden: usize,
        vpps: usize,
    ) -> (VppTaskGraph, usize) {
        let cfg = ModelConfig {
            vocab: 30,
            hidden,
            classes: 5,
        };
        let model = build_model_with(name, &cfg, &ModelOptions { dropout }).expect("model");
        let prog = PersistentProgram::build(&model).expect("program");
        let refs: Vec<&InputGraph> = graphs.iter().collect();
        let s = ramus_exec::Batch::new(&model, refs, ramus_graph::BatchingPolicy::Cavs)
            .expect("schedule")
            .schedule;
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let batch =
            unroll_batch(&model, &prog, &s, true, vpps, usize::MAX, &mut rng).expect("lowered");
        assert!(
            batch.upload_at >= prog.params.total,
            "batch values after the parameters"
        );
        assert!(batch.zeroed.start >= prog.params.total && batch.zeroed.end <= batch.upload_at);
        assert!(batch.loss_at >= batch.zeroed.start && batch.loss_at < batch.zeroed.end);
        let rp = plan(
            &prog.matrices,
            &DeviceLimits::hopper(vpps),
            &PlanRequest::new(1),
        )
        .expect("plan");
        let mut scheduler = Scheduler::new(&rp);
        scheduler.holder_item = PRODUCT_ITEM_WORDS;
        let schedule = scheduler.schedule(&batch.graph).expect("scripts");
        // every task runs on the processors its placement names, after its
        // dependencies, without deadlock
        let order = simulate(&schedule, &batch.graph).expect("the scripts run to the end");
        assert_eq!(order.len(), batch.graph.len());
        (batch.graph, schedule.levels)
    }

    /// Products of at least `host_items` items become host work between
    /// launches: the graph splits into launches that each schedule and run
    /// in dependency order, the products left in the kernel are narrower,
    /// a biased product's rows get the bias first, every product's rows lie
    /// in the batch's regions, and the update comes last.
    #[test]
    fn wide_products_lower_to_host_work_between_launches() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let graphs: Vec<InputGraph> = (0..6)
            .map(|_| random_tree(&mut rng, 9, &[2], 30, 5).expect("tree"))
            .collect();
        let refs: Vec<&InputGraph> = graphs.iter().collect();
        let host_items = 8;
        for name in ["treelstm", "treegru"] {
            for in_registers in [true, false] {
                let what = format!("{name}, register gradients {in_registers}");
                let cfg = ModelConfig {
                    vocab: 30,
                    hidden: 20,
                    classes: 5,
                };
                let model =
                    build_model_with(name, &cfg, &ModelOptions { dropout: 0.0 }).expect("model");
                let prog = PersistentProgram::build(&model).expect("program");
                let s = ramus_exec::Batch::new(&model, refs.clone(), BatchingPolicy::Cavs)
                    .expect("schedule")
                    .schedule;
                let mut masks = ChaCha8Rng::seed_from_u64(1);
                let batch =
                    unroll_batch(&model, &prog, &s, in_registers, 6, host_items, &mut masks)
                        .expect("lowered");
                let (mut forward, mut backward, mut gradients) = (0, 0, 0);
                for work in &batch.host_work {
                    match *work {
                        HostWork::Product {
                            rows,
                            transposed,
                            output,
                            output_stride,
                            input,
                            ..
                        } => {
                            assert!(rows >= host_items, "{what}: {rows} rows");
                            let last = output + (rows - 1) * output_stride;
                            assert!(batch.zeroed.contains(&output) && batch.zeroed.contains(&last));
                            assert!(input >= prog.params.total && input < batch.end, "{what}");
                            if transposed {
                                backward += 1;
                            } else {
                                forward += 1;
                            }
                        }
                        HostWork::Gradient(g) => {
                            assert!(g.rows >= host_items, "{what}");
                            gradients += 1;
                        }
                    }
                }
                assert!(
                    forward > 0 && backward > 0,
                    "{what}: {forward} / {backward}"
                );
                // with gradients outside registers they go to `gemms` whatever
                // their size
                assert_eq!(gradients > 0, in_registers, "{what}");
                // the products left to the kernel are narrower
                for t in &batch.graph.tasks {
                    if matches!(t.op, OP_MATVEC | OP_MATVEC_T) {
                        assert!(t.operands.len() / PRODUCT_ITEM_WORDS < host_items, "{what}");
                    }
                }
                // the leaves' biased product: its rows get the bias (a row
                // copy from a stride-0 source) before cuBLAS adds to them
                assert!(
                    batch
                        .graph
                        .tasks
                        .iter()
                        .any(|t| t.op == OP_ROWS && t.operands[5] == 0),
                    "{what}: no bias broadcast"
                );
                let work = batch.host_work.len();
                let launches = ramus_core::vpps::split_launches(batch.graph).expect("launches");
                assert!(launches.len() >= 3, "{what}: {} launches", launches.len());
                let mut named: Vec<u32> =
                    launches.iter().flat_map(|l| l.host_after.clone()).collect();
                named.sort_unstable();
                assert_eq!(
                    named,
                    (0..work as u32).collect::<Vec<_>>(),
                    "{what}: all host work"
                );
                let rp = plan(
                    &prog.matrices,
                    &DeviceLimits::hopper(6),
                    &PlanRequest::new(1),
                )
                .expect("plan");
                let mut scheduler = Scheduler::new(&rp);
                scheduler.holder_item = PRODUCT_ITEM_WORDS;
                for (i, l) in launches.iter().enumerate() {
                    if l.graph.is_empty() {
                        continue;
                    }
                    let schedule = scheduler.schedule(&l.graph).expect("scripts");
                    let order = simulate(&schedule, &l.graph).expect("the scripts run");
                    assert_eq!(order.len(), l.graph.len(), "{what}: launch {i}");
                    let updates = l.graph.tasks.iter().any(|t| t.op == OP_UPDATE);
                    assert_eq!(updates, in_registers && i + 1 == launches.len(), "{what}");
                }
            }
        }
    }

    #[test]
    fn tree_batches_lower_to_scripts_that_run_in_dependency_order() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let graphs = vec![
            random_tree(&mut rng, 1, &[2], 30, 5).expect("a single leaf"),
            random_tree(&mut rng, 12, &[1, 2, 3], 30, 5).expect("tree"),
            random_path(&mut rng, 25, 30, 5).expect("path"),
        ];
        // the binary TreeFC reads two children: the tree binarized, and a
        // 25-deep caterpillar (a leaf beside each vertex of the path)
        let mut binary = vec![
            graphs[0].clone(),
            binarize(&graphs[1], Side::Left, 1).expect("binarized"),
        ];
        let mut caterpillar = InputGraph::new();
        let mut top = caterpillar.push_vertex(&[], 1, 0).expect("leaf");
        for i in 1..25 {
            let leaf = caterpillar.push_vertex(&[], i, 0).expect("leaf");
            top = caterpillar.push_vertex(&[top, leaf], 0, 1).expect("vertex");
        }
        binary.push(caterpillar);
        for name in ["treelstm", "treegru", "treefc"] {
            let graphs = if name == "treefc" { &binary } else { &graphs };
            let (g, levels) = lowered(name, graphs, 0.0);
            if name == "treelstm" {
                // the child-sum Tree-LSTM's child gradients are added into
                // the children's rows by the fused groups computing them:
                // the only row scatter-adds left are the head's, a row per
                // root
                let scattered: u32 = g
                    .tasks
                    .iter()
                    .filter(|t| t.op == OP_ROWS && t.arg == ROWS_ACCUMULATE | ROWS_DST_ABSOLUTE)
                    .map(|t| t.operands[0])
                    .sum();
                assert_eq!(scattered as usize, graphs.len(), "{name}");
            }
            // the 25-deep path alone needs a level per vertex each way
            assert!(levels > 50, "{name}: {levels} levels");
            let updates = g.tasks.iter().filter(|t| t.op == OP_UPDATE).count();
            assert_eq!(
                updates, 1,
                "{name}: one register update for every processor"
            );
            let sink = g.tasks.iter().position(|t| t.op == OP_NOP).expect("a sink");
            assert_eq!(
                g.tasks[sink].deps.len(),
                sink,
                "{name}: the sink follows every task"
            );
        }
    }

    #[test]
    fn binary_trees_chains_and_dropout_lower_too() {
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        let trees = vec![
            random_tree(&mut rng, 9, &[2], 30, 5).expect("tree"),
            random_tree(&mut rng, 1, &[2], 30, 5).expect("leaf"),
        ];
        lowered("treelstm-nary", &trees, 0.2);
        let chains = vec![random_chain(&mut rng, 7, 30).expect("chain")];
        lowered("lstm-lm", &chains, 0.0);
    }

    /// A caterpillar tree's internal vertices are a chain, a perfect tree's
    /// levels are as wide as can be: each level of either costs the
    /// Tree-LSTM two barriers forward (the products; the forget gates, the
    /// cell, the next gathers and the children's pushes into their
    /// parent's sum chained on one processor — the gates' edges cut with
    /// their vertex) and two
    /// backward (the transposed products; the gate gradients, which their
    /// group adds into the children's gradient rows, chained), the
    /// bias-gradient sums running at the end instead of in those chains.
    #[test]
    fn a_tree_level_costs_two_barriers_each_way() {
        let levels = |internal: usize| {
            let mut g = InputGraph::new();
            let mut top = g.push_vertex(&[], 1, 0).expect("leaf");
            for i in 0..internal {
                let leaf = g.push_vertex(&[], 2 + i as u32, 0).expect("leaf");
                top = g.push_vertex(&[top, leaf], 0, 1).expect("vertex");
            }
            lowered_on("treelstm", &[g], 0.0, 256, 132).1
        };
        let (short, long) = (levels(4), levels(10));
        assert_eq!(long - short, 4 * 6, "levels {short} and {long}");
        // in a perfect tree both children of a vertex finish at the same
        // level, on different processors: their sum of `h` is pushed by
        // each child as it finishes, so the parent's products need no
        // level of their own for it
        let perfect = |height: u32| {
            let mut rng = ChaCha8Rng::seed_from_u64(height.into());
            let tree = ramus_graph::random::perfect_tree(&mut rng, height, 30, 5).expect("tree");
            lowered_on("treelstm", &[tree], 0.0, 256, 132).1
        };
        let (short, long) = (perfect(4), perfect(7));
        assert_eq!(long - short, 4 * 3, "levels {short} and {long}");
    }

    /// A batch lowered with the stream set past the masks of the batches
    /// before it (a batch prepared ahead) draws the masks it would draw
    /// lowered after them.
    #[test]
    fn a_batch_prepared_ahead_draws_the_masks_it_would_draw_in_turn() {
        let cfg = ModelConfig {
            vocab: 30,
            hidden: 6,
            classes: 5,
        };
        let model =
            build_model_with("treelstm", &cfg, &ModelOptions { dropout: 0.3 }).expect("model");
        let prog = PersistentProgram::build(&model).expect("program");
        let mut trees = ChaCha8Rng::seed_from_u64(8);
        let batches: Vec<Schedule> = [3, 1, 2]
            .iter()
            .map(|&n| {
                let graphs: Vec<InputGraph> = (0..n)
                    .map(|_| random_tree(&mut trees, 7, &[2], 30, 5).expect("tree"))
                    .collect();
                let refs: Vec<&InputGraph> = graphs.iter().collect();
                ramus_exec::Batch::new(&model, refs, ramus_graph::BatchingPolicy::Cavs)
                    .expect("schedule")
                    .schedule
            })
            .collect();
        let mut in_turn = ChaCha8Rng::seed_from_u64(2);
        let mut ahead = in_turn.clone();
        let mut skipped = 0u128;
        for (i, s) in batches.iter().enumerate() {
            let a =
                unroll_batch(&model, &prog, s, true, 6, usize::MAX, &mut in_turn).expect("lowered");
            let mut positioned = ahead.clone();
            positioned.set_word_pos(ahead.get_word_pos() + 2 * skipped);
            let b = unroll_batch(&model, &prog, s, true, 6, usize::MAX, &mut positioned)
                .expect("lowered");
            assert!(dropout_draws(&model, s) > 0, "batch {i} has masks");
            assert_eq!(a.upload, b.upload, "batch {i}: the same masks");
            assert_eq!(
                positioned.get_word_pos(),
                in_turn.get_word_pos(),
                "batch {i}"
            );
            skipped += dropout_draws(&model, s);
        }
        ahead.set_word_pos(ahead.get_word_pos() + 2 * skipped);
        assert_eq!(ahead.get_word_pos(), in_turn.get_word_pos());
    }

    #[test]
    fn unsupported_inputs_are_named() {
        let cfg = ModelConfig {
            vocab: 10,
            hidden: 4,
            classes: 2,
        };
        let model = build_model_with("treelstm", &cfg, &ModelOptions::default()).expect("model");
        let prog = PersistentProgram::build(&model).expect("program");
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        // leaf token 42 is outside the 10-row embedding table
        let mut g = InputGraph::new();
        let a = g.push_vertex(&[], 3, -1).expect("leaf");
        let b = g.push_vertex(&[], 42, -1).expect("leaf");
        g.push_vertex(&[a, b], 0, 1).expect("root");
        let refs = vec![&g];
        let s = ramus_exec::Batch::new(&model, refs, ramus_graph::BatchingPolicy::Cavs)
            .expect("schedule")
            .schedule;
        match unroll_batch(&model, &prog, &s, true, 6, usize::MAX, &mut rng) {
            Err(e) => assert!(e.to_string().contains("token id 42"), "wrong error: {e}"),
            Ok(_) => panic!("a token outside the table was accepted"),
        }
    }
}

#[cfg(test)]
mod timing {
    use super::*;
    use ramus_core::vpps::isa::PRODUCT_ITEM_WORDS;
    use ramus_core::vpps::{plan, DeviceLimits, PlanRequest, Scheduler};
    use ramus_graph::random::random_tree;
    use ramus_graph::InputGraph;
    use ramus_nn::{build_model_with, ModelConfig, ModelOptions};
    use rand::SeedableRng;

    /// The persistent kernel's CUDA source for the reference models at h
    /// 256 and 512 under every register-plan choice, one file each into
    /// `RAMUS_KERNEL_SOURCE_DIR`, for reading the compiler's register use
    /// (`nvcc -cubin -arch=sm_90 -Xptxas -v`) where there is no GPU.
    #[test]
    #[ignore]
    fn kernel_sources() {
        use ramus_codegen::persistent::{kernel_source, KernelOptions, UpdateRule};
        let Ok(dir) = std::env::var("RAMUS_KERNEL_SOURCE_DIR") else {
            eprintln!("RAMUS_KERNEL_SOURCE_DIR is not set: nothing written");
            return;
        };
        std::fs::create_dir_all(&dir).expect("source directory");
        for hidden in [256, 512] {
            let cfg = ModelConfig {
                vocab: 2000,
                hidden,
                classes: 5,
            };
            let model =
                build_model_with("treelstm", &cfg, &ModelOptions::default()).expect("model");
            let prog = PersistentProgram::build(&model).expect("program");
            for rpw in 1..=4 {
                for ctas in 1..=2 {
                    for grads in [true, false] {
                        let req = PlanRequest {
                            rpw,
                            ctas_per_sm: Some(ctas),
                            grads_in_registers: Some(grads),
                        };
                        let Ok(rp) = plan(&prog.matrices, &DeviceLimits::hopper(132), &req) else {
                            continue;
                        };
                        // the vector epilogue's, and the scalar one's
                        // (`_scalar`), which a plan falls back to where the
                        // first spills
                        for vector_epilogue in [true, false] {
                            let options = KernelOptions {
                                vector_epilogue,
                                ..UpdateRule::Sgd.into()
                            };
                            let source = kernel_source(&rp, options, &prog.fused_source);
                            let name = format!(
                                "h{hidden}_rpw{rpw}_ctas{ctas}_grads{}{}.cu",
                                u8::from(grads),
                                if vector_epilogue { "" } else { "_scalar" }
                            );
                            std::fs::write(std::path::Path::new(&dir).join(name), source)
                                .expect("source written");
                        }
                    }
                }
            }
        }
    }

    /// Host cost of lowering and scheduling a batch (`cargo test --release
    /// -p ramus-cuda host_cost -- --ignored --nocapture`; the model from
    /// `RAMUS_HOST_COST_MODEL`, batch sizes from `RAMUS_HOST_COST_SIZES`).
    #[test]
    #[ignore]
    fn host_cost() {
        let cfg = ModelConfig {
            vocab: 2000,
            hidden: 256,
            classes: 5,
        };
        let name = std::env::var("RAMUS_HOST_COST_MODEL").unwrap_or_else(|_| "treelstm".into());
        let model = build_model_with(&name, &cfg, &ModelOptions::default()).expect("model");
        let prog = PersistentProgram::build(&model).expect("program");
        let rp = plan(
            &prog.matrices,
            &DeviceLimits::hopper(132),
            &PlanRequest::new(1),
        )
        .expect("plan");
        let mut scheduler = Scheduler::new(&rp);
        scheduler.record = false;
        scheduler.holder_item = PRODUCT_ITEM_WORDS;
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let sizes: Vec<usize> = std::env::var("RAMUS_HOST_COST_SIZES")
            .ok()
            .map(|v| v.split(',').filter_map(|s| s.parse().ok()).collect())
            .unwrap_or_else(|| vec![1, 8, 128]);
        let reps: usize = std::env::var("RAMUS_HOST_COST_REPS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(20);
        for bs in sizes {
            // the time-delay networks read a tree's leaves as a pyramid
            let pyramids = name.starts_with("td-");
            let graphs: Vec<InputGraph> = (0..bs)
                .map(|_| {
                    let tree = random_tree(&mut rng, 19, &[2], 2000, 5).expect("tree");
                    if pyramids {
                        ramus_graph::sequence::pyramid_of_tree(&tree).expect("pyramid")
                    } else {
                        tree
                    }
                })
                .collect();
            let refs: Vec<&InputGraph> = graphs.iter().collect();
            let t0 = std::time::Instant::now();
            let (mut tasks, mut levels, mut words) = (0, 0, (0, 0, 0));
            let (mut t_sched, mut t_unroll, mut t_scripts) = (0.0, 0.0, 0.0);
            for _ in 0..reps {
                let a = std::time::Instant::now();
                let s =
                    ramus_exec::Batch::new(&model, refs.clone(), ramus_graph::BatchingPolicy::Cavs)
                        .expect("schedule")
                        .schedule;
                let b = std::time::Instant::now();
                let batch = unroll_batch(&model, &prog, &s, true, rp.ctas, usize::MAX, &mut rng)
                    .expect("lowered");
                let c = std::time::Instant::now();
                let sc = scheduler.schedule(&batch.graph).expect("scripts");
                let d = std::time::Instant::now();
                tasks = batch.graph.len();
                levels = sc.levels;
                words = (
                    batch.upload.len(),
                    sc.packed.words.len(),
                    batch.zeroed.len(),
                );
                t_sched += (b - a).as_secs_f64();
                t_unroll += (c - b).as_secs_f64();
                t_scripts += (d - c).as_secs_f64();
            }
            let total = t0.elapsed().as_secs_f64() / reps as f64 * 1e3;
            println!(
                "bs {bs}: {tasks} tasks, {levels} levels, {total:.3} ms (schedule {:.3}, lower {:.3}, scripts {:.3}); words: upload {}, scripts {}, zeroed {}",
                t_sched / reps as f64 * 1e3,
                t_unroll / reps as f64 * 1e3,
                t_scripts / reps as f64 * 1e3,
                words.0,
                words.1,
                words.2
            );
        }
    }
}
