//! Cortex's recursion scheduling primitives for the compiled inference
//! engines (Cortex §3.1, §4.1, §7.4): the **schedule** choice (recursive
//! refactoring and unrolling, each on, off or the best known default per
//! model and back end) and the **recursive refactoring** transformation,
//! applied to a model's vertex functions before they are lowered
//! ([`lower_scheduled`]).
//!
//! # Recursive refactoring (Cortex Fig. 5)
//!
//! A parent often computes, per child, a value that depends on that child's
//! state alone: the child-sum Tree-LSTM's forget term `σ(U_f h_k + b_f) ⊙
//! c_k`, the TreeGRU's `σ(U_r h_k + b_r) ⊙ h_k`, a chain LSTM's `W_h h_prev`.
//! Refactoring moves the recursion back-edge: the **child** computes these
//! values right after its own state, from that state, and stores them with
//! it (the state row is widened by their columns); the parent reads them
//! from the child's row instead of recomputing them. The transformation
//! works on the vertex-function graphs:
//!
//! 1. In the internal function, a node is **child-only** when it depends on
//!    the children's states through one child reference alone (`gather_all`
//!    in edge space, or one `gather(k)` in vertex space) and otherwise on
//!    parameters only, with no reduction over children on the way. The
//!    **moved values** are the child-only nodes computed by a product that a
//!    node which is not child-only (or an output) reads.
//! 2. In the internal function those nodes become slices of the widened
//!    child state; every function (leaf and internal) then appends the
//!    moved values' computation, applied to its own new state in vertex
//!    space, to its scattered state.
//!
//! Because a leaf computes its moved values in its own cell, leaf
//! specialization tabulates them per token with the rest of the leaf: the
//! parents' per-edge products on leaf children disappear from inference.
//! A value read through `gather(k)` must vanish on a zero state (a missing
//! child reads zeros, where the original computed the value of zeros):
//! one that does not (a bias) is left in place.
//!
//! A moved value is computed once per child node and read by every parent,
//! so on a DAG a vertex with several parents does no repeated work (the
//! repetition the paper warns of for DAGs comes from recomputing, which
//! this scheme never does): refactoring runs on trees, sequences and DAGs.
//! Unrolling does not (a child shared by two unrolled parents would have
//! to be computed twice); the engines refuse it on a DAG input.

use crate::error::{CoreError, Result};
use crate::graph::{DType, Graph, Node, NodeId, NodeKind, Output, Role, Source, Space, ValueType};
use crate::lower::{embedding_rows, lower, CellProgram};
use crate::op::OpDef;
use crate::ops::{Concat, Op, Slice};
use crate::Model;

/// The back end a schedule default is chosen for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Cpu,
    Cuda,
}

/// The recursion primitives of a compiled-engine schedule: `None` picks
/// the best known setting for the model and back end
/// ([`RecursionSchedule::resolve`]); `Some` is the user's choice.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecursionSchedule {
    /// Recursive refactoring (see the module docs). Asking for it on a
    /// model with nothing to refactor is an error.
    pub refactor: Option<bool>,
    /// Recursion unrolled once: a node is computed together with its
    /// children of the level below (see the engines' docs).
    pub unroll: Option<bool>,
}

/// A schedule with every choice made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ResolvedRecursion {
    pub refactor: bool,
    pub unroll: bool,
}

impl RecursionSchedule {
    /// Both primitives forced on or off.
    pub fn fixed(refactor: bool, unroll: bool) -> Self {
        RecursionSchedule {
            refactor: Some(refactor),
            unroll: Some(unroll),
        }
    }

    /// The choices for `model` on `backend`, defaults filled in:
    ///
    /// * refactoring, on the CPU: on where the moved values are read per
    ///   child edge (`gather_all`: the child-sum Tree-LSTM, the TreeGRU)
    ///   and leaf tables absorb them: the per-edge products on leaf
    ///   children vanish (faster on SST trees at hidden 256:
    ///   `docs/benchmarks.md#cpu-recursion-primitives`); off for values read
    ///   through `gather(k)` (a chain: the same products, moved, plus one
    ///   for the last node and a stage). On CUDA: off until measured on a
    ///   device (the child's moved products need every unit of its new
    ///   state: a grid barrier per level is added);
    /// * unrolling: off on both (on the CPU no faster than level by level,
    ///   a level's child states already sit in cache at these sizes; on
    ///   CUDA it gives model persistence up, Cortex §7.4 and appendix D).
    ///
    /// An explicit `Some(true)` for refactoring on a model with nothing to
    /// refactor is an error naming the model.
    pub fn resolve(
        &self,
        model: &Model,
        backend: Backend,
        leaf_table: bool,
    ) -> Result<ResolvedRecursion> {
        let analysis = analyze(model)?;
        let refactor = match self.refactor {
            Some(true) => {
                if analysis.is_empty() {
                    return Err(nothing_to_refactor(model));
                }
                true
            }
            Some(false) => false,
            None => {
                backend == Backend::Cpu
                    && leaf_table
                    && !analysis.is_empty()
                    && analysis.iter().all(|m| m.key == ChildKey::Edge)
            }
        };
        Ok(ResolvedRecursion {
            refactor,
            unroll: self.unroll.unwrap_or(false),
        })
    }
}

fn nothing_to_refactor(model: &Model) -> CoreError {
    CoreError::Shape {
        context: "recursive refactoring".into(),
        op: model.name.clone(),
        message: "the model has nothing to refactor: its internal function computes no \
                  product from one child's state alone (a value mixing several children, \
                  like W [h_l; h_r], or a sum over children, stays with the parent); \
                  switch refactoring off"
            .into(),
    }
}

/// How a child-only value reaches the child states.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ChildKey {
    /// Through `gather_all()`: one edge row per child.
    Edge,
    /// Through `gather(k)`.
    Index(usize),
}

impl ChildKey {
    fn space(self) -> Space {
        match self {
            ChildKey::Edge => Space::Edge,
            ChildKey::Index(_) => Space::Vertex,
        }
    }
    fn source(self) -> Source {
        match self {
            ChildKey::Edge => Source::GatherAll,
            ChildKey::Index(k) => Source::Gather(k),
        }
    }
}

/// A value refactoring moves into the child.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MovedValue {
    /// Its node in the internal function's forward graph.
    pub node: NodeId,
    pub key: ChildKey,
    pub width: usize,
    /// Its columns in the widened state row.
    pub columns: std::ops::Range<usize>,
}

/// What a node depends on, for the child-only analysis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reach {
    /// Parameters and constants only.
    Static,
    /// One child reference (and parameters).
    Child(ChildKey),
    /// Anything else.
    Mixed,
}

fn combine(a: Reach, b: Reach) -> Reach {
    match (a, b) {
        (Reach::Static, x) | (x, Reach::Static) => x,
        (Reach::Child(p), Reach::Child(q)) if p == q => Reach::Child(p),
        _ => Reach::Mixed,
    }
}

fn reach(g: &Graph) -> Vec<Reach> {
    let mut out: Vec<Reach> = Vec::with_capacity(g.nodes.len());
    for node in &g.nodes {
        let r = match &node.kind {
            NodeKind::Input(Source::GatherAll) => Reach::Child(ChildKey::Edge),
            NodeKind::Input(Source::Gather(k)) => Reach::Child(ChildKey::Index(*k)),
            NodeKind::Input(Source::DropoutMask { .. }) | NodeKind::Param(_) => Reach::Static,
            NodeKind::Input(_) => Reach::Mixed,
            NodeKind::Op(op) => {
                if op.crosses_edges() {
                    Reach::Mixed
                } else {
                    let r = node
                        .inputs
                        .iter()
                        .fold(Reach::Static, |acc, &x| combine(acc, out[x]));
                    match r {
                        Reach::Child(key)
                            if node.ty.space != key.space() || node.ty.dtype != DType::Float =>
                        {
                            Reach::Mixed
                        }
                        other => other,
                    }
                }
            }
        };
        out.push(r);
    }
    out
}

/// True when node `i` (child-only through `gather(k)`) is zero whenever
/// the child state is: a missing child then reads the same zeros as the
/// value it would have computed.
fn vanishes_on_zero(g: &Graph, i: NodeId, memo: &mut Vec<Option<bool>>) -> bool {
    if let Some(v) = memo[i] {
        return v;
    }
    let node = &g.nodes[i];
    let v = match &node.kind {
        NodeKind::Input(Source::Gather(_)) => true,
        NodeKind::Input(_) | NodeKind::Param(_) => false,
        NodeKind::Op(op) => {
            let inputs = node.inputs.clone();
            if matches!(op, Op::MatMul(_)) {
                vanishes_on_zero(g, inputs[0], memo)
            } else if matches!(op, Op::Mul(_)) {
                inputs.iter().any(|&x| vanishes_on_zero(g, x, memo))
            } else if matches!(op, Op::Slice(_) | Op::Concat(_)) {
                inputs.iter().all(|&x| vanishes_on_zero(g, x, memo))
            } else if op.elementwise_template().is_some()
                && inputs.iter().all(|&x| vanishes_on_zero(g, x, memo))
            {
                // the op itself must map zeros to zero (tanh does, sigmoid
                // not); an empty row has nothing to map
                node.ty.width() == 0 || op.maps_zero_to_zero()
            } else {
                false
            }
        }
    };
    memo[i] = Some(v);
    v
}

/// The values refactoring would move for `g` (an internal function's
/// forward graph with scatter / push outputs `outputs`), without widths'
/// column ranges filled (`state_width` = the unwidened state).
fn moved_values(g: &Graph, outputs: &[NodeId], state_width: usize) -> Vec<MovedValue> {
    let reach = reach(g);
    let mut product = vec![false; g.nodes.len()];
    for (i, node) in g.nodes.iter().enumerate() {
        product[i] = matches!(reach[i], Reach::Child(_))
            && (matches!(node.op(), Some(Op::MatMul(_)))
                || node.inputs.iter().any(|&x| product[x]));
    }
    let mut read_outside = vec![false; g.nodes.len()];
    for (i, node) in g.nodes.iter().enumerate() {
        if reach[i] == Reach::Mixed {
            for &x in &node.inputs {
                read_outside[x] = true;
            }
        }
    }
    for &o in outputs {
        read_outside[o] = true;
    }
    let mut memo = vec![None; g.nodes.len()];
    let mut moved = Vec::new();
    let mut at = state_width;
    for (i, node) in g.nodes.iter().enumerate() {
        let Reach::Child(key) = reach[i] else {
            continue;
        };
        if !product[i] || !read_outside[i] {
            continue;
        }
        if matches!(key, ChildKey::Index(_)) && !vanishes_on_zero(g, i, &mut memo) {
            continue;
        }
        let width = node.ty.width();
        moved.push(MovedValue {
            node: i,
            key,
            width,
            columns: at..at + width,
        });
        at += width;
    }
    moved
}

/// The (leaf, internal) function indices of a compiled model.
fn leaf_internal(model: &Model) -> Result<(usize, usize)> {
    match model.selector {
        crate::FunctionSelector::LeafInternal { leaf, internal } => Ok((leaf, internal)),
        crate::FunctionSelector::Single(f) => Ok((f, f)),
        crate::FunctionSelector::ByKind(_) => Err(CoreError::Shape {
            context: "compiled-engine lowering".into(),
            op: model.name.clone(),
            message: "the compiled engines run one leaf and one internal function; this model \
                      selects its functions by vertex kind (use the batched engine)"
                .into(),
        }),
    }
}

fn function_outputs(model: &Model, f: usize) -> Result<(&Graph, NodeId, NodeId)> {
    let func = model.functions.get(f).ok_or_else(|| CoreError::Shape {
        context: "compiled-engine lowering".into(),
        op: model.name.clone(),
        message: format!("the selector names function {f}, which does not exist"),
    })?;
    match (func.scatter, func.push) {
        (Some(s), Some(p)) => Ok((&func.forward, s, p)),
        _ => Err(CoreError::Shape {
            context: "compiled-engine lowering".into(),
            op: model.name.clone(),
            message: format!(
                "function `{}` must scatter a state and push a value to be compiled",
                func.name
            ),
        }),
    }
}

/// The values recursive refactoring moves into the child for `model`
/// (empty: nothing to refactor).
pub fn analyze(model: &Model) -> Result<Vec<MovedValue>> {
    let (_, internal) = leaf_internal(model)?;
    let (g, scatter, push) = function_outputs(model, internal)?;
    Ok(moved_values(
        g,
        &[scatter, push],
        g.nodes[scatter].ty.width(),
    ))
}

/// A graph being rebuilt node by node.
struct Rebuild {
    nodes: Vec<Node>,
}

impl Rebuild {
    fn push(&mut self, node: Node) -> NodeId {
        self.nodes.push(node);
        self.nodes.len() - 1
    }

    /// Applies `op` to `inputs`, its type inferred.
    fn op(&mut self, op: impl Into<Op>, inputs: Vec<NodeId>) -> Result<NodeId> {
        let op: Op = op.into();
        let types: Vec<&ValueType> = inputs.iter().map(|&x| &self.nodes[x].ty).collect();
        let ty = op.infer(&types).map_err(|message| CoreError::Shape {
            context: "recursive refactoring".into(),
            op: op.signature(),
            message,
        })?;
        Ok(self.push(Node {
            kind: NodeKind::Op(op),
            inputs,
            ty,
        }))
    }

    /// Appends the computation of `value` (a child-only node of `src`) in
    /// vertex space, with the child state replaced by node `state`.
    fn clone_on_state(
        &mut self,
        src: &Graph,
        value: NodeId,
        state: NodeId,
        memo: &mut Vec<Option<NodeId>>,
    ) -> Result<NodeId> {
        if let Some(n) = memo[value] {
            return Ok(n);
        }
        let node = &src.nodes[value];
        let id = match &node.kind {
            NodeKind::Input(Source::GatherAll | Source::Gather(_)) => state,
            NodeKind::Input(source) => {
                let mut ty = node.ty.clone();
                if ty.space == Space::Edge {
                    ty.space = Space::Vertex;
                }
                self.push(Node {
                    kind: NodeKind::Input(*source),
                    inputs: Vec::new(),
                    ty,
                })
            }
            NodeKind::Param(_) => self.push(node.clone()),
            NodeKind::Op(op) => {
                let mut inputs = Vec::with_capacity(node.inputs.len());
                for &x in &node.inputs {
                    inputs.push(self.clone_on_state(src, x, state, memo)?);
                }
                self.op(op.clone(), inputs)?
            }
        };
        memo[value] = Some(id);
        Ok(id)
    }

    /// `state` widened by the moved values computed on it: the new scatter.
    fn widen_state(
        &mut self,
        internal: &Graph,
        moved: &[MovedValue],
        state: NodeId,
    ) -> Result<NodeId> {
        let mut memo = vec![None; internal.nodes.len()];
        let mut parts = vec![state];
        for m in moved {
            parts.push(self.clone_on_state(internal, m.node, state, &mut memo)?);
        }
        self.op(Concat, parts)
    }
}

/// A vertex function rewritten by refactoring: its graph and its
/// (scatter, push) nodes.
#[derive(Clone, Debug)]
pub struct RewrittenFunction {
    pub graph: Graph,
    pub scatter: NodeId,
    pub push: NodeId,
}

fn with_outputs(
    g: &Graph,
    nodes: Vec<Node>,
    scatter: NodeId,
    push: NodeId,
    remap: &[NodeId],
) -> RewrittenFunction {
    let mut outputs: Vec<Output> = g
        .outputs
        .iter()
        .map(|o| Output {
            role: o.role,
            node: remap[o.node],
            aux: o.aux.map(|a| remap[a]),
        })
        .collect();
    for o in &mut outputs {
        if o.role == Role::Scatter {
            o.node = scatter;
        }
    }
    RewrittenFunction {
        graph: Graph { nodes, outputs },
        scatter,
        push,
    }
}

/// The internal function reading `moved` from its children's widened
/// rows (`state_width` columns before them) and widening its own state.
fn rewrite_internal(
    g: &Graph,
    scatter: NodeId,
    push: NodeId,
    moved: &[MovedValue],
    state_width: usize,
) -> Result<RewrittenFunction> {
    let widened = moved.last().map_or(state_width, |m| m.columns.end);
    let mut b = Rebuild { nodes: Vec::new() };
    let mut remap = vec![usize::MAX; g.nodes.len()];
    // the widened child inputs (only those a moved value reads are widened)
    let mut wide_input: Vec<(ChildKey, NodeId)> = Vec::new();
    for (i, node) in g.nodes.iter().enumerate() {
        if let Some(m) = moved.iter().find(|m| m.node == i) {
            let wide = wide_input
                .iter()
                .find(|(k, _)| *k == m.key)
                .map(|&(_, n)| n)
                .ok_or_else(|| CoreError::Shape {
                    context: "recursive refactoring".into(),
                    op: "internal function".into(),
                    message: format!("moved node %{i} precedes its child input"),
                })?;
            remap[i] = b.op(
                Slice {
                    start: m.columns.start,
                    len: m.width,
                },
                vec![wide],
            )?;
            continue;
        }
        let key = match node.kind {
            NodeKind::Input(Source::GatherAll) => Some(ChildKey::Edge),
            NodeKind::Input(Source::Gather(k)) => Some(ChildKey::Index(k)),
            _ => None,
        };
        if let Some(key) = key.filter(|k| moved.iter().any(|m| m.key == *k)) {
            let wide = b.push(Node {
                kind: NodeKind::Input(key.source()),
                inputs: Vec::new(),
                ty: ValueType::rows(key.space(), widened),
            });
            wide_input.push((key, wide));
            let width = node.ty.width();
            remap[i] = b.op(
                Slice {
                    start: 0,
                    len: width,
                },
                vec![wide],
            )?;
            continue;
        }
        let mut copy = node.clone();
        copy.inputs.iter_mut().for_each(|x| *x = remap[*x]);
        remap[i] = b.push(copy);
    }
    let new_scatter = b.widen_state(g, moved, remap[scatter])?;
    let push = remap[push];
    Ok(with_outputs(g, b.nodes, new_scatter, push, &remap))
}

/// A leaf function widening its state by `moved` (computed as the
/// internal graph `internal` would on a child).
fn rewrite_leaf(
    g: &Graph,
    scatter: NodeId,
    push: NodeId,
    internal: &Graph,
    moved: &[MovedValue],
) -> Result<RewrittenFunction> {
    let mut b = Rebuild {
        nodes: g.nodes.clone(),
    };
    let new_scatter = b.widen_state(internal, moved, scatter)?;
    let remap: Vec<NodeId> = (0..g.nodes.len()).collect();
    Ok(with_outputs(g, b.nodes, new_scatter, push, &remap))
}

/// A lowered vertex function: the graph its program was lowered from (the
/// ops' code templates come from it) and the program.
#[derive(Clone, Debug)]
pub struct LoweredFunction {
    pub graph: Graph,
    pub program: CellProgram,
}

/// A model's cells for a compiled engine under a recursion schedule.
#[derive(Clone, Debug)]
pub struct ScheduledCells {
    /// The leaf cell (outputs: scattered state, pushed value).
    pub leaf: LoweredFunction,
    /// The internal cell (outputs: scattered state, pushed value).
    pub internal: LoweredFunction,
    /// The head's scores (lowered from the model's head graph).
    pub head: CellProgram,
    /// Rows of the embedding table the cells read, if they read a token.
    pub vocab: Option<usize>,
    /// The values refactoring moved into the children (empty without).
    pub moved: Vec<MovedValue>,
    /// The model's own state width (a refactored state row is wider).
    pub base_state_width: usize,
}

impl ScheduledCells {
    /// Columns of a state row as the engines store it.
    pub fn state_width(&self) -> usize {
        self.internal.program.output_width(0)
    }
}

/// Lowers `model` for a compiled engine, refactored (see the module docs)
/// when `refactor` is set: an error if the model has nothing to refactor.
pub fn lower_scheduled(model: &Model, refactor: bool) -> Result<ScheduledCells> {
    let (leaf_f, internal_f) = leaf_internal(model)?;
    let (ig, is, ip) = function_outputs(model, internal_f)?;
    let (lg, ls, lp) = function_outputs(model, leaf_f)?;
    let base_state_width = ig.nodes[is].ty.width();
    let moved = if refactor {
        let moved = moved_values(ig, &[is, ip], base_state_width);
        if moved.is_empty() {
            return Err(nothing_to_refactor(model));
        }
        moved
    } else {
        Vec::new()
    };
    let (leaf, internal) = if moved.is_empty() {
        (
            RewrittenFunction {
                graph: lg.clone(),
                scatter: ls,
                push: lp,
            },
            RewrittenFunction {
                graph: ig.clone(),
                scatter: is,
                push: ip,
            },
        )
    } else {
        let internal = rewrite_internal(ig, is, ip, &moved, base_state_width)?;
        let leaf = if leaf_f == internal_f {
            internal.clone()
        } else {
            rewrite_leaf(lg, ls, lp, ig, &moved)?
        };
        (leaf, internal)
    };
    let lowered = |f: RewrittenFunction| -> Result<LoweredFunction> {
        let program = lower(&f.graph, &[f.scatter, f.push])?;
        Ok(LoweredFunction {
            graph: f.graph,
            program,
        })
    };
    let (leaf, internal) = (lowered(leaf)?, lowered(internal)?);
    let logits = model.head.logits.ok_or_else(|| CoreError::Shape {
        context: "compiled-engine lowering".into(),
        op: model.name.clone(),
        message: "the head computes no scores".into(),
    })?;
    let head = lower(&model.head.forward, &[logits])?;
    let vocab = embedding_rows(model, &[&leaf.program, &internal.program]);
    Ok(ScheduledCells {
        leaf,
        internal,
        head,
        vocab,
        moved,
        base_state_width,
    })
}
