//! What a run needs in memory, computed from the model and the data before
//! anything large is allocated, so that a command can refuse sizes that
//! cannot fit (naming the flag or input to change) instead of aborting
//! on a failed allocation or growing until the machine kills it.
//!
//! The estimate follows how the batched engines size their buffers
//! (`ramus_cpu::CpuEngine`'s arenas; the CUDA engine's `alloc_bufs` sizes
//! its batch arena the same way):
//!
//! * **model state**: every parameter's elements ([`param_bytes`]); the
//!   gradients (`Grads::zeros`: one dense tensor per parameter); the
//!   optimizer's moments ([`optimizer_copies`]: SGD none, Adagrad one,
//!   Adam two, each parameter-sized); the packed copies of the weights
//!   small-row products read ([`packed_weight_bytes`]); per-token tables
//!   where evaluation uses them ([`token_table_bytes`]);
//! * **activations** ([`ActivationCost`]): for each vertex function, every
//!   node of its forward graph (and of `∂F` when training) holds
//!   `rows × width` elements for vertex-space values, `edges × width` for
//!   edge-space values and its whole shape for static ones (parameters and
//!   the forward values a backward graph reads are not copied); the head
//!   the same over its rows, plus the copy of the logits a forward pass
//!   returns; the vertex states (and their gradients) `vertices ×
//!   state width`; the batch's schedule, [`SCHEDULE_WORDS_PER_VERTEX`] and
//!   [`SCHEDULE_WORDS_PER_EDGE`] 4-byte words and a copy of the vertices'
//!   features (an image's pixels);
//! * **the largest batch** ([`GraphCosts`]): activations are a sum over the
//!   batch's graphs (plus the static part), so the most a batch of `B`
//!   graphs can need is the static part plus the `B` largest per-graph
//!   costs, whatever the shuffle; where graphs run in order (evaluation),
//!   the most any of their consecutive chunks needs.
//!
//! A device engine whose buffers differ (the persistent and compiled CUDA
//! engines) states its own per-unit costs ([`CostTerms`],
//! [`ActivationCost::from_terms`]) in a [`DeviceNeed`], which a caller's
//! [`DeviceCheck`] compares with the device's room before the engine
//! allocates; the same [`GraphCosts`] then give its largest batch.
//!
//! Every element is 4 bytes (`f32` values, `u32` indices). A graph's cost
//! depends only on its [`GraphShape`], so a graph whose shape follows from
//! its input (a time-delay pyramid from its word count) is costed before
//! it is built. Not counted: scratch inside kernels (a convolution's
//! unfolded input), allocator rounding and `Vec` growth slack, and the
//! input graphs themselves (read before the check, so already outside the
//! memory it is made against; [`GraphShape::input_bytes`] gives their
//! size for a check made before building them).
//! Arithmetic saturates, so absurd sizes give `u64::MAX`, never a wrap.

use ramus_core::graph::{Graph, NodeKind, Source, Space};
use ramus_core::ops::Op;
use ramus_core::plan::token_hoist;
use ramus_core::{HeadRows, Model, OpDef};
use ramus_graph::{GraphShape, InputGraph};

use crate::optim::OptimizerKind;

/// Bytes of one element (`f32` value or `u32` index).
pub const ELEMENT_BYTES: u64 = 4;
/// 4-byte words a batch's schedule keeps per vertex: its number, function,
/// row, token, label and graph, the function's row list and edge offsets,
/// and the child offsets, heights, functions and task lists of its build.
pub const SCHEDULE_WORDS_PER_VERTEX: u64 = 12;
/// 4-byte words a batch's schedule keeps per child edge (the children, and
/// each function's edge children and parents) plus the engine's local edges.
pub const SCHEDULE_WORDS_PER_EDGE: u64 = 4;

/// `count × width` elements, in bytes (saturating).
fn bytes(count: u64, width: u64) -> u64 {
    count.saturating_mul(width).saturating_mul(ELEMENT_BYTES)
}

/// Elements of `shape` (saturating).
fn elements(shape: &[usize]) -> u64 {
    shape.iter().fold(1u64, |n, &d| n.saturating_mul(d as u64))
}

/// Bytes of all of `model`'s parameters and buffers.
pub fn param_bytes(model: &Model) -> u64 {
    model
        .params
        .iter()
        .fold(0u64, |s, p| s.saturating_add(bytes(elements(&p.shape), 1)))
}

/// The largest parameter: its index and bytes (`None` for a model without).
pub fn largest_param(model: &Model) -> Option<(usize, u64)> {
    model
        .params
        .iter()
        .enumerate()
        .map(|(i, p)| (i, bytes(elements(&p.shape), 1)))
        .max_by_key(|&(_, b)| b)
}

/// Parameter-sized copies an optimizer keeps (`Optimizer::new`): Adam its
/// first and second moments, Adagrad its sum of squares, SGD nothing.
pub fn optimizer_copies(kind: OptimizerKind) -> u64 {
    match kind {
        OptimizerKind::Sgd => 0,
        OptimizerKind::Adagrad => 1,
        OptimizerKind::Adam => 2,
    }
}

/// The model-sized memory of training, by part: the parameters, their
/// gradients and the optimizer's moments (what `Params::init` and
/// `Trainer::new` allocate on the host, and a device engine beside them;
/// the CPU engine adds its [`packed_weight_bytes`]).
pub fn training_state(model: &Model, optimizer: OptimizerKind) -> Vec<(&'static str, u64)> {
    let p = param_bytes(model);
    vec![
        ("parameters", p),
        ("gradients", p),
        (
            "optimizer state",
            p.saturating_mul(optimizer_copies(optimizer)),
        ),
    ]
}

/// Bytes of the packed weights the CPU engine keeps for small-row products:
/// one copy per parameter and orientation an op packs.
pub fn packed_weight_bytes(model: &Model) -> u64 {
    let mut packed = std::collections::BTreeSet::new();
    for g in graphs_of(model, Pass::Train) {
        for node in &g.nodes {
            let Some(want) = node.op().and_then(|op| op.packed_operand()) else {
                continue;
            };
            if let Some(NodeKind::Param(p)) = node.inputs.get(1).map(|&b| &g.nodes[b].kind) {
                packed.insert((*p, want.trans_b));
            }
        }
    }
    packed.into_iter().fold(0u64, |s, (p, _)| {
        s.saturating_add(bytes(elements(&model.params[p].shape), 1))
    })
}

/// Bytes of the per-token tables evaluation builds for `vocab` tokens
/// (`CpuEngine::use_token_tables`; the compiled engines' leaf tables hold
/// the same values): one row per token, up to the function's smallest
/// embedding table, for each token-only value.
pub fn token_table_bytes(model: &Model, vocab: usize) -> u64 {
    model.functions.iter().fold(0u64, |s, f| {
        let g = &f.forward;
        let rows = embedding_rows(model, g).map_or(vocab, |r| r.min(vocab)) as u64;
        token_hoist(g).tabulated.iter().fold(s, |s, &n| {
            s.saturating_add(bytes(rows, g.nodes[n].ty.width() as u64))
        })
    })
}

/// The fewest rows among the embedding tables `graph` looks tokens up in
/// (`None` when it looks up none): the tokens a per-token table spans.
pub fn embedding_rows(model: &Model, graph: &Graph) -> Option<usize> {
    graph
        .nodes
        .iter()
        .filter(|n| matches!(n.op(), Some(Op::Embedding(_))))
        .filter_map(|n| match graph.nodes.get(*n.inputs.first()?)?.kind {
            NodeKind::Param(p) => model.params.get(p)?.shape.first().copied(),
            _ => None,
        })
        .min()
}

/// Which passes a command runs over a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    /// Forward and backward (training).
    Train,
    /// Forward with the loss; for a model whose head reads the roots, the
    /// head again over every labelled vertex (`ramus_nn::evaluate`).
    Evaluate,
    /// Forward to the scores.
    Infer,
}

/// The graphs a pass runs: each function's forward graph (and its
/// backward graph when training), then the head's.
fn graphs_of(model: &Model, pass: Pass) -> Vec<&Graph> {
    let mut out: Vec<&Graph> = model.functions.iter().map(|f| &f.forward).collect();
    out.push(&model.head.forward);
    if pass == Pass::Train {
        out.extend(model.functions.iter().map(|f| &f.backward));
        out.push(&model.head.backward);
    }
    out
}

/// Bytes a graph's buffers need per vertex row, per edge row and in all
/// (static values), as an engine arena holds them.
fn arena_widths(g: &Graph) -> (u64, u64, u64) {
    let (mut row, mut edge, mut fixed) = (0u64, 0u64, 0u64);
    for node in &g.nodes {
        if matches!(
            node.kind,
            NodeKind::Param(_) | NodeKind::Input(Source::Forward(_))
        ) {
            continue;
        }
        let w = node.ty.width() as u64;
        match node.ty.space {
            Space::Vertex => row = row.saturating_add(bytes(1, w)),
            Space::Edge => edge = edge.saturating_add(bytes(1, w)),
            Space::Static => fixed = fixed.saturating_add(bytes(1, w)),
        }
    }
    (row, edge, fixed)
}

/// Activation bytes of a pass per unit of each of a batch's counts,
/// computed once from the model's graphs (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ActivationCost {
    pass: Pass,
    head_rows: HeadRows,
    /// Per vertex function: bytes per row it runs and per child edge.
    per_row: Vec<u64>,
    per_edge: Vec<u64>,
    /// Bytes per head row: the head's buffers and the returned logits.
    per_head_row: u64,
    /// Bytes per vertex: states (and their gradients), the schedule.
    per_vertex: u64,
    /// Bytes per child edge outside the functions' buffers (the schedule).
    per_any_edge: u64,
    /// Static values, whatever the batch.
    fixed: u64,
}

impl ActivationCost {
    /// The costs of `pass` over `model`'s graphs.
    pub fn new(model: &Model, pass: Pass) -> Self {
        let train = pass == Pass::Train;
        let mut fixed = 0u64;
        let (mut per_row, mut per_edge) = (Vec::new(), Vec::new());
        for f in &model.functions {
            let (mut r, mut e, s) = arena_widths(&f.forward);
            fixed = fixed.saturating_add(s);
            if train {
                let (br, be, bs) = arena_widths(&f.backward);
                (r, e) = (r.saturating_add(br), e.saturating_add(be));
                fixed = fixed.saturating_add(bs);
            }
            per_row.push(r);
            per_edge.push(e);
        }
        let head = &model.head;
        let (mut per_head_row, _, s) = arena_widths(&head.forward);
        fixed = fixed.saturating_add(s);
        if train {
            let (r, _, s) = arena_widths(&head.backward);
            per_head_row = per_head_row.saturating_add(r);
            fixed = fixed.saturating_add(s);
        }
        if let Some(l) = head.logits {
            per_head_row =
                per_head_row.saturating_add(bytes(1, head.forward.nodes[l].ty.width() as u64));
        }
        let states = if train { 2 } else { 1 };
        let per_vertex = bytes(states, model.state_width as u64)
            .saturating_add(bytes(SCHEDULE_WORDS_PER_VERTEX, 1));
        ActivationCost {
            pass,
            head_rows: head.rows,
            per_row,
            per_edge,
            per_head_row,
            per_vertex,
            per_any_edge: bytes(SCHEDULE_WORDS_PER_EDGE, 1),
            fixed,
        }
    }

    /// The costs of `pass` with `terms` per unit of a batch's counts: for
    /// an engine whose buffers are not the batched engines' (the
    /// persistent and compiled CUDA engines derive theirs from their own
    /// allocation code).
    pub fn from_terms(model: &Model, pass: Pass, terms: CostTerms) -> Self {
        ActivationCost {
            pass,
            head_rows: model.head.rows,
            per_row: terms.per_row,
            per_edge: terms.per_edge,
            per_head_row: terms.per_head_row,
            per_vertex: terms.per_vertex,
            per_any_edge: terms.per_any_edge,
            fixed: terms.fixed,
        }
    }

    /// The host's share of `pass` when a device engine runs it: the
    /// batch's schedule and the scores it brings back (the buffers
    /// [`ActivationCost::new`] counts are on the device).
    pub fn host_side(model: &Model, pass: Pass) -> Self {
        let n = model.functions.len();
        let head = &model.head;
        let logits = head
            .logits
            .map_or(0, |l| bytes(1, head.forward.nodes[l].ty.width() as u64));
        ActivationCost {
            pass,
            head_rows: head.rows,
            per_row: vec![0; n],
            per_edge: vec![0; n],
            per_head_row: logits,
            per_vertex: bytes(SCHEDULE_WORDS_PER_VERTEX, 1),
            per_any_edge: bytes(SCHEDULE_WORDS_PER_EDGE, 1),
            fixed: 0,
        }
    }

    /// The static part: bytes a batch needs however small it is.
    pub fn fixed(&self) -> u64 {
        self.fixed
    }

    /// Bytes `g` adds to any batch it is in (without the static part).
    pub fn graph_bytes(&self, model: &Model, g: &InputGraph) -> u64 {
        self.shape_bytes(model, &g.shape())
    }

    /// Bytes a graph of `shape` adds to any batch it is in (without the
    /// static part): what [`ActivationCost::graph_bytes`] gives for it,
    /// known before it is built (a pyramid from its word count).
    pub fn shape_bytes(&self, model: &Model, shape: &GraphShape) -> u64 {
        let mut total = 0u64;
        for &(kind, kids, count) in &shape.vertices {
            let edges = kids as u64;
            let mut each = self
                .per_vertex
                .saturating_add(edges.saturating_mul(self.per_any_edge));
            // a vertex no function runs is refused by the schedule
            if let Some(f) = model.selector.select(kind, kids) {
                let row = self.per_row.get(f).copied().unwrap_or(0);
                let edge = self.per_edge.get(f).copied().unwrap_or(0);
                each = each
                    .saturating_add(row)
                    .saturating_add(edges.saturating_mul(edge));
            }
            total = total.saturating_add(count.saturating_mul(each));
        }
        // the schedule's copy of the graph's features
        total = total.saturating_add(bytes(shape.features, 1));
        let head_rows = match (self.head_rows, self.pass) {
            (HeadRows::Labelled, _) => shape.labelled,
            // evaluation runs the head again over the labelled vertices
            (HeadRows::Roots, Pass::Evaluate) => shape.roots.max(shape.labelled),
            (HeadRows::Roots, _) => shape.roots,
        };
        total.saturating_add(head_rows.saturating_mul(self.per_head_row))
    }

    /// The per-graph costs of `graphs` (see [`GraphCosts`]).
    pub fn graph_costs(&self, model: &Model, graphs: &[InputGraph]) -> GraphCosts {
        let in_order: Vec<u64> = graphs.iter().map(|g| self.graph_bytes(model, g)).collect();
        let mut sorted: Vec<(u64, usize)> = in_order.iter().copied().zip(0..).collect();
        sorted.sort_unstable_by(|a, b| b.cmp(a));
        GraphCosts {
            fixed: self.fixed,
            in_order,
            sorted,
        }
    }
}

/// Bytes per unit of a batch's counts ([`ActivationCost::from_terms`]);
/// the units are those [`ActivationCost::graph_bytes`] counts: a vertex
/// function's rows and child edges, the head's rows, every vertex and
/// edge, and the batch itself.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CostTerms {
    /// Per vertex function: bytes per row it runs and per child edge.
    pub per_row: Vec<u64>,
    pub per_edge: Vec<u64>,
    pub per_head_row: u64,
    pub per_vertex: u64,
    pub per_any_edge: u64,
    /// Whatever the batch.
    pub fixed: u64,
}

impl CostTerms {
    /// No bytes for any unit of a model of `functions` vertex functions.
    pub fn zero(functions: usize) -> Self {
        CostTerms {
            per_row: vec![0; functions],
            per_edge: vec![0; functions],
            ..CostTerms::default()
        }
    }
}

/// A batch's bytes beyond its linear costs, measured by preparing the
/// batch (see [`DeviceNeed::train_extra`]).
pub type BatchExtra = std::sync::Arc<dyn Fn(&[&InputGraph]) -> Result<u64, String> + Send + Sync>;

/// What a device engine will allocate on its device for a run, worked out
/// from the model and the engine's options before it allocates anything
/// large, so that a caller can refuse a run that cannot fit (see
/// [`DeviceCheck`]): model-sized parts, and the linear costs of a training
/// and an evaluation batch.
#[derive(Clone)]
pub struct DeviceNeed {
    /// The engine, e.g. `cuda-persistent`.
    pub engine: &'static str,
    /// Model-sized allocations by name (parameters, optimizer state,
    /// per-token tables, kernel tables), in bytes.
    pub parts: Vec<(&'static str, u64)>,
    /// A training batch's buffers (`None`: the engine does not train).
    pub train: Option<ActivationCost>,
    /// An evaluation or inference batch's buffers (`None`: the engine
    /// does not evaluate).
    pub eval: Option<ActivationCost>,
    /// The largest training batch's buffers stay allocated while
    /// evaluation batches run (the persistent engine keeps its batch region
    /// beside the engine that evaluates); else each batch's buffers are
    /// reused by the next.
    pub train_kept: bool,
    /// What a training batch of the given graphs needs beyond `train`'s
    /// linear costs, found by preparing it on the host (the persistent
    /// engine's instruction scripts, whose size no per-graph cost gives);
    /// ask only once the linear costs fit, since preparing a batch too large
    /// costs host memory and time.
    pub train_extra: Option<BatchExtra>,
    /// The same for an evaluation or inference batch (the compiled
    /// engine's node counters, which count the batch's internal nodes).
    pub eval_extra: Option<BatchExtra>,
}

impl std::fmt::Debug for DeviceNeed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceNeed")
            .field("engine", &self.engine)
            .field("parts", &self.parts)
            .field("train", &self.train)
            .field("eval", &self.eval)
            .field("train_kept", &self.train_kept)
            .field("train_extra", &self.train_extra.is_some())
            .field("eval_extra", &self.eval_extra.is_some())
            .finish()
    }
}

impl DeviceNeed {
    /// The model-sized parts' bytes.
    pub fn parts_bytes(&self) -> u64 {
        self.parts.iter().fold(0u64, |s, p| s.saturating_add(p.1))
    }
}

/// The device memory an engine can take: what the device has free (for
/// every process on it) and the caller's budget, if any.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceRoom {
    pub free: u64,
    pub budget: Option<u64>,
}

impl DeviceRoom {
    /// The bytes a run may take: the free memory, within the budget.
    pub fn bytes(&self) -> u64 {
        self.budget.map_or(self.free, |b| b.min(self.free))
    }
}

/// What a [`DeviceCheck`] found fits, in bytes, for the engine to size
/// its buffers once instead of growing them: the largest training batch's
/// linear costs and what it needs beyond them
/// ([`DeviceNeed::train_extra`]), and the largest evaluation batch's and
/// what it needs beyond them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fitted {
    pub train_batch: u64,
    pub train_extra: u64,
    pub eval_batch: u64,
    pub eval_extra: u64,
}

/// A caller's check that a run fits an engine's device: given what the
/// engine will allocate and the room it has, what fits, or an error naming
/// what to change. Engines call it before their first large allocation.
pub type DeviceCheck<'a> = &'a dyn Fn(&DeviceNeed, DeviceRoom) -> Result<Fitted, String>;

/// The activation bytes each graph of a data set adds to its batch, and
/// the static part every batch needs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GraphCosts {
    fixed: u64,
    /// Per graph, in the data set's order.
    in_order: Vec<u64>,
    /// `(bytes, index of the graph)`, most expensive first.
    sorted: Vec<(u64, usize)>,
}

impl GraphCosts {
    /// The most a batch of `batch_size` of these graphs, in any order
    /// (shuffled training batches), can need: the static part plus the
    /// `batch_size` largest costs.
    pub fn largest_batch(&self, batch_size: usize) -> u64 {
        self.sorted
            .iter()
            .take(batch_size)
            .fold(self.fixed, |s, &(b, _)| s.saturating_add(b))
    }

    /// The most a batch needs when the graphs run in order, `batch_size`
    /// at a time (evaluation, inference, a bench's first inputs).
    pub fn largest_chunk(&self, batch_size: usize) -> u64 {
        self.in_order
            .chunks(batch_size.max(1))
            .map(|c| c.iter().fold(self.fixed, |s, &b| s.saturating_add(b)))
            .max()
            .unwrap_or(self.fixed)
    }

    /// The most expensive graph: its index and what a batch of it alone needs.
    pub fn costliest(&self) -> Option<(usize, u64)> {
        self.sorted
            .first()
            .map(|&(b, i)| (i, b.saturating_add(self.fixed)))
    }

    /// The indices of the `batch_size` most expensive graphs: the largest
    /// batch [`GraphCosts::largest_batch`] counts.
    pub fn costliest_graphs(&self, batch_size: usize) -> Vec<usize> {
        self.sorted
            .iter()
            .take(batch_size)
            .map(|&(_, i)| i)
            .collect()
    }

    /// What a batch of the cheapest graph alone needs (`None` without graphs).
    pub fn cheapest(&self) -> Option<u64> {
        self.sorted
            .last()
            .map(|&(b, _)| b.saturating_add(self.fixed))
    }

    /// The largest batch size up to `batch_size` whose batches need at most
    /// `bytes` in any order (0 when not even one graph fits).
    pub fn fitting_batch(&self, batch_size: usize, bytes: u64) -> usize {
        let mut need = self.fixed;
        for (k, &(b, _)) in self.sorted.iter().take(batch_size).enumerate() {
            need = need.saturating_add(b);
            if need > bytes {
                return k;
            }
        }
        batch_size.min(self.sorted.len())
    }

    /// Number of graphs.
    pub fn len(&self) -> usize {
        self.in_order.len()
    }

    /// True when there is no graph.
    pub fn is_empty(&self) -> bool {
        self.in_order.is_empty()
    }
}
