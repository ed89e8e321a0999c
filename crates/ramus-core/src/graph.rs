//! The graph IR: a small static dataflow graph of registered ops. Vertex
//! functions `F`, their derivatives `∂F` and static heads are all `Graph`s.
//!
//! Every value lives in a *space* that says how many rows it has when a
//! batching task runs: one row per vertex of the task ([`Space::Vertex`]),
//! one row per child edge of the task's vertices ([`Space::Edge`]), or a
//! single fixed-shape tensor ([`Space::Static`]: parameters, reductions over
//! rows, the loss). Row values carry a per-row width; a static vector of the
//! same width broadcasts over rows (a bias).

use std::collections::HashMap;

use crate::error::{CoreError, Result};
use crate::op::OpDef;
use crate::ops::Op;
pub use crate::types::{DType, Space, ValueType};

/// Index of a node inside its [`Graph`].
pub type NodeId = usize;
/// Index of a parameter inside its model's parameter table.
pub type ParamId = usize;

/// Leaf values an engine supplies when it runs a graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    /// `gather(k)`: the scattered state of child `k` (zeros if absent).
    Gather(usize),
    /// `gather_all()`: the scattered state of every child, one edge row each.
    GatherAll,
    /// `pull()`: an external float input per vertex.
    Pull,
    /// The vertex's token id (an index row), for embedding lookups.
    Token,
    /// The class label of each head row (an index row).
    Label,
    /// The pushed value of each vertex the head is attached to.
    HeadInput,
    /// A dropout mask (0 or `1 / (1 - rate)` per element while training, 1
    /// otherwise) for dropout site `site`, `rate` in units of 1e-4.
    DropoutMask { site: u16, rate: u16 },
    /// In a backward graph: the forward value of node `n` of the forward graph.
    Forward(NodeId),
    /// In a backward graph: the gradient flowing into forward output `i`.
    OutputGrad(usize),
}

/// What a node is.
#[derive(Clone, Debug)]
pub enum NodeKind {
    /// A value supplied by the engine.
    Input(Source),
    /// A model parameter.
    Param(ParamId),
    /// A registered op applied to the node's inputs.
    Op(Op),
}

/// One node of a graph.
#[derive(Clone, Debug)]
pub struct Node {
    pub kind: NodeKind,
    pub inputs: Vec<NodeId>,
    pub ty: ValueType,
}

impl Node {
    /// The op, if this node applies one.
    pub fn op(&self) -> Option<&Op> {
        match &self.kind {
            NodeKind::Op(op) => Some(op),
            _ => None,
        }
    }
    /// The product's attributes, if this node is a [`MatMul`](crate::ops::MatMul)
    /// (the op most passes look at).
    pub fn matmul(&self) -> Option<&crate::ops::MatMul> {
        match self.op() {
            Some(Op::MatMul(mm)) => Some(mm),
            _ => None,
        }
    }
    /// A short description: op name, input source or parameter.
    pub fn describe(&self, params: &[String]) -> String {
        match &self.kind {
            NodeKind::Op(op) => op.signature(),
            NodeKind::Param(p) => format!(
                "param {}",
                params.get(*p).map(String::as_str).unwrap_or("?")
            ),
            NodeKind::Input(s) => format!("{s:?}").to_lowercase(),
        }
    }
}

/// What a graph output means to the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// `scatter(x)`: the vertex state its parents gather.
    Scatter,
    /// `push(x)`: the value exported to the head / external consumers.
    Push,
    /// The scalar training loss (head).
    Loss,
    /// Per-row class scores used for predictions (head).
    Logits,
    /// Backward: gradient for the state of child `k`.
    ChildGrad(usize),
    /// Backward: gradient for the state of every child (edge rows).
    ChildGradAll,
    /// Backward: gradient of the pulled external input.
    PullGrad,
    /// Backward (head): gradient of each head row's pushed value.
    HeadInputGrad,
    /// Backward: a dense contribution to a parameter's gradient.
    ParamGrad(ParamId),
    /// Backward: rows added into a parameter's gradient at the indices of
    /// the output's `aux` node (sparse embedding gradients).
    ParamRowGrad(ParamId),
}

/// A graph output: a role, the node holding it and, for
/// [`Role::ParamRowGrad`], the index node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Output {
    pub role: Role,
    pub node: NodeId,
    pub aux: Option<NodeId>,
}

/// A static dataflow graph: nodes in topological order plus outputs.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    pub nodes: Vec<Node>,
    pub outputs: Vec<Output>,
}

impl Graph {
    /// The first output with `role`.
    pub fn output(&self, role: Role) -> Option<&Output> {
        self.outputs.iter().find(|o| o.role == role)
    }

    /// The node that supplies `source`, if the graph reads it.
    pub fn input_node(&self, source: Source) -> Option<NodeId> {
        self.nodes
            .iter()
            .position(|n| matches!(n.kind, NodeKind::Input(s) if s == source))
    }

    /// Which nodes an output names, as its node or its `aux` node.
    pub fn output_mask(&self) -> Vec<bool> {
        let mut out = vec![false; self.nodes.len()];
        for o in &self.outputs {
            for x in std::iter::once(o.node).chain(o.aux) {
                if let Some(slot) = out.get_mut(x) {
                    *slot = true;
                }
            }
        }
        out
    }

    /// Users of every node (nodes that read it), in node order.
    pub fn users(&self) -> Vec<Vec<NodeId>> {
        let mut users = vec![Vec::new(); self.nodes.len()];
        for (i, n) in self.nodes.iter().enumerate() {
            for &x in &n.inputs {
                users[x].push(i);
            }
        }
        users
    }

    /// Marks the nodes that some output (transitively) depends on.
    pub fn live_nodes(&self) -> Vec<bool> {
        let mut live = vec![false; self.nodes.len()];
        for o in &self.outputs {
            live[o.node] = true;
            if let Some(a) = o.aux {
                live[a] = true;
            }
        }
        for i in (0..self.nodes.len()).rev() {
            if live[i] {
                for &x in &self.nodes[i].inputs {
                    live[x] = true;
                }
            }
        }
        live
    }

    /// Removes nodes no output depends on, renumbering the rest.
    pub fn prune(&self) -> Graph {
        self.retain(&self.live_nodes())
    }

    /// Keeps the nodes marked in `keep`, renumbering them and the outputs
    /// (with their `aux` nodes). Every kept node's inputs and every output
    /// must be kept too.
    pub(crate) fn retain(&self, keep: &[bool]) -> Graph {
        let mut remap = vec![usize::MAX; self.nodes.len()];
        let mut nodes = Vec::new();
        for (i, n) in self.nodes.iter().enumerate() {
            if keep[i] {
                remap[i] = nodes.len();
                let mut n = n.clone();
                n.inputs.iter_mut().for_each(|x| *x = remap[*x]);
                nodes.push(n);
            }
        }
        let outputs = self
            .outputs
            .iter()
            .map(|o| Output {
                role: o.role,
                node: remap[o.node],
                aux: o.aux.map(|a| remap[a]),
            })
            .collect();
        Graph { nodes, outputs }
    }

    /// A readable listing, one node per line (`ramus inspect`, debugging).
    pub fn listing(&self, params: &[String]) -> String {
        let mut s = String::new();
        for (i, n) in self.nodes.iter().enumerate() {
            let ins: Vec<String> = n.inputs.iter().map(|x| format!("%{x}")).collect();
            s += &format!(
                "%{i} = {}({}) : {}\n",
                n.describe(params),
                ins.join(", "),
                n.ty
            );
        }
        for o in &self.outputs {
            s += &format!(
                "{:?} <- %{}{}\n",
                o.role,
                o.node,
                o.aux.map(|a| format!(" at %{a}")).unwrap_or_default()
            );
        }
        s
    }
}

/// A handle to a value inside a [`GraphBuilder`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Sym(pub(crate) NodeId);

impl Sym {
    /// The node id this handle refers to.
    pub fn id(self) -> NodeId {
        self.0
    }
    const POISON: Sym = Sym(usize::MAX);
}

/// Builds a [`Graph`] op by op. Shape errors are recorded (the first one is
/// kept and later ops become no-ops) so model code reads like math and the
/// error surfaces once, naming the op, when the graph is finished.
pub struct GraphBuilder {
    graph: Graph,
    context: String,
    error: Option<CoreError>,
    param_types: Vec<ValueType>,
    param_nodes: HashMap<ParamId, NodeId>,
    input_nodes: HashMap<Source, NodeId>,
}

impl GraphBuilder {
    /// A builder for a graph called `context` (used in error messages) that
    /// may reference parameters with the given shapes.
    pub fn new(context: &str, param_shapes: &[Vec<usize>]) -> Self {
        GraphBuilder {
            graph: Graph::default(),
            context: context.to_string(),
            error: None,
            param_types: param_shapes.iter().map(|s| ValueType::fixed(s)).collect(),
            param_nodes: HashMap::new(),
            input_nodes: HashMap::new(),
        }
    }

    /// The value type of `s` (None for a poisoned handle).
    pub fn ty(&self, s: Sym) -> Option<&ValueType> {
        self.graph.nodes.get(s.0).map(|n| &n.ty)
    }

    /// Row width of `s` (0 for a poisoned handle).
    pub fn width(&self, s: Sym) -> usize {
        self.ty(s).map(|t| t.width()).unwrap_or(0)
    }

    /// True once an error has been recorded.
    pub fn failed(&self) -> bool {
        self.error.is_some()
    }

    /// Records an error (only the first is kept).
    pub fn fail(&mut self, op: &str, message: impl Into<String>) -> Sym {
        if self.error.is_none() {
            self.error = Some(CoreError::Shape {
                context: self.context.clone(),
                op: op.to_string(),
                message: message.into(),
            });
        }
        Sym::POISON
    }

    fn push(&mut self, kind: NodeKind, inputs: Vec<NodeId>, ty: ValueType) -> Sym {
        self.graph.nodes.push(Node { kind, inputs, ty });
        Sym(self.graph.nodes.len() - 1)
    }

    /// A parameter as a value (one node per parameter).
    pub fn param(&mut self, p: ParamId) -> Sym {
        if let Some(&n) = self.param_nodes.get(&p) {
            return Sym(n);
        }
        let Some(ty) = self.param_types.get(p).cloned() else {
            return self.fail("param", format!("parameter id {p} does not exist"));
        };
        let s = self.push(NodeKind::Param(p), vec![], ty);
        self.param_nodes.insert(p, s.0);
        s
    }

    /// An engine-supplied input (one node per source).
    pub fn input(&mut self, source: Source, ty: ValueType) -> Sym {
        if let Some(&n) = self.input_nodes.get(&source) {
            if self.graph.nodes[n].ty != ty {
                let have = self.graph.nodes[n].ty.clone();
                return self.fail(
                    "input",
                    format!("{source:?} declared twice with types {have} and {ty}"),
                );
            }
            return Sym(n);
        }
        let s = self.push(NodeKind::Input(source), vec![], ty);
        self.input_nodes.insert(source, s.0);
        s
    }

    /// Applies a registered op, inferring the result type.
    pub fn apply(&mut self, op: impl Into<Op>, inputs: &[Sym]) -> Sym {
        let op: Op = op.into();
        if self.failed() || inputs.contains(&Sym::POISON) {
            return Sym::POISON;
        }
        if let Some(bad) = inputs.iter().find(|s| s.0 >= self.graph.nodes.len()) {
            return self.fail(
                op.name(),
                format!("input %{} is not a value of this graph", bad.0),
            );
        }
        let tys: Vec<&ValueType> = inputs.iter().map(|s| &self.graph.nodes[s.0].ty).collect();
        match op.infer(&tys) {
            Ok(ty) => self.push(NodeKind::Op(op), inputs.iter().map(|s| s.0).collect(), ty),
            Err(msg) => {
                let shown: Vec<String> = tys.iter().map(|t| t.to_string()).collect();
                let sig = op.signature();
                self.fail(&sig, format!("{msg} (inputs: {})", shown.join(", ")))
            }
        }
    }

    /// Declares an output.
    pub fn output(&mut self, role: Role, value: Sym, aux: Option<Sym>) {
        if value == Sym::POISON || aux == Some(Sym::POISON) {
            return;
        }
        if !matches!(role, Role::ParamRowGrad(_))
            && self.graph.outputs.iter().any(|o| o.role == role)
        {
            self.fail(&format!("{role:?}"), "declared twice");
            return;
        }
        self.graph.outputs.push(Output {
            role,
            node: value.0,
            aux: aux.map(|a| a.0),
        });
    }

    /// Finishes the graph, returning the first recorded error if any.
    pub fn finish(self) -> Result<Graph> {
        match self.error {
            Some(e) => Err(e),
            None => Ok(self.graph),
        }
    }

    /// Number of dropout sites declared so far.
    pub fn dropout_sites(&self) -> usize {
        self.input_nodes
            .keys()
            .filter(|s| matches!(s, Source::DropoutMask { .. }))
            .count()
    }

    /// Read access to the graph built so far.
    pub fn graph(&self) -> &Graph {
        &self.graph
    }
}
