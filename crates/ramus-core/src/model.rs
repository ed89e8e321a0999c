//! Model declaration (the Cavs API): parameters with initialisers, one or
//! more vertex functions built symbolically with `gather` / `gather_all` /
//! `scatter` / `pull` / `push`, which function runs at which vertex, and a
//! static head attached to chosen vertices. A [`Model`] is built once —
//! differentiated and classified for execution — and reused for every batch.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::{Deref, DerefMut};

pub use crate::arity::FunctionSelector;
use crate::arity::{self, Arity, VertexRules};
use crate::autodiff::differentiate;
use crate::error::{CoreError, Result};
use crate::graph::{Graph, GraphBuilder, NodeId, Role, Source, Space, Sym, ValueType};
use crate::plan::{classify, ExecPlan};
use crate::simplify::pads_to_concat;

/// How a parameter's initial values are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    Zeros,
    /// Normal with mean 0 and the given standard deviation.
    Normal {
        std: f64,
    },
    /// Uniform on `[-bound, bound]`.
    Uniform {
        bound: f64,
    },
    /// PyTorch's `nn.Linear` default: uniform on `±1/sqrt(fan_in)` (fan_in = last dim).
    LinearDefault,
    /// Glorot/Xavier uniform: `±sqrt(6 / (fan_in + fan_out))`.
    Xavier,
    /// He/Kaiming normal for layers followed by ReLU: standard deviation
    /// `sqrt(2 / fan_in)`, where fan_in is the product of every dimension
    /// but the first (`C*kh*kw` for a convolution weight `[O, C, kh, kw]` or
    /// `[O, C*kh*kw]`, the input width of a linear weight `[O, I]`).
    Kaiming,
    /// Every element set to `value` (batch-norm scales start at 1).
    Constant {
        value: f64,
    },
    /// Identity blocks plus noise: the elements in order, read as rows of
    /// `n` columns, stack `n × n` blocks whose diagonals are `scale`; every
    /// element gets normal noise of standard deviation `std`. An MV-RNN's
    /// word matrices (`[V, n²]`: one identity per word) and its `W_Mᵀ`
    /// (`[2n, n]`: `[I; I]·½`) start this way.
    Identity {
        n: usize,
        scale: f64,
        std: f64,
    },
}

/// What a declared parameter is for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ParamKind {
    /// A trained weight: receives gradients and optimizer updates.
    #[default]
    Trained,
    /// A non-trained buffer (batch normalisation's running statistics): the
    /// engines update it during training passes, it never receives a
    /// gradient, and optimizers (host and device) leave it alone — no step,
    /// no weight decay. Saved in checkpoints like any parameter.
    Buffer,
}

/// A declared parameter.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub init: Init,
    pub kind: ParamKind,
}

impl VertexRules {
    /// The rules of `model`.
    pub fn of(model: &Model) -> VertexRules {
        let functions = model
            .functions
            .iter()
            .map(|f| (f.name.clone(), f.arity))
            .collect();
        VertexRules::new(model.name.clone(), model.selector.clone(), functions)
    }
}

/// The vertices the head reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadRows {
    /// Each graph's roots (vertices no other vertex has as a child).
    Roots,
    /// Every vertex that has a label (per-node losses, language models).
    Labelled,
}

/// A vertex function `F` with its derivative and execution plans.
#[derive(Clone, Debug)]
pub struct VertexFunction {
    pub name: String,
    pub forward: Graph,
    pub backward: Graph,
    pub forward_plan: ExecPlan,
    pub backward_plan: ExecPlan,
    /// Node of `forward` that is scattered (the vertex state), if any.
    pub scatter: Option<NodeId>,
    /// Node of `forward` that is pushed to the head, if any.
    pub push: Option<NodeId>,
    /// Largest `k` used by `gather(k)`, plus one.
    pub gather_arity: usize,
    /// The children a vertex it runs at must have ([`Model::function_for`]).
    pub arity: Arity,
}

impl VertexFunction {
    /// The input of `∂F` that receives the gradient of `F`'s output with
    /// `role` (the state gradient for [`Role::Scatter`], the pushed value's
    /// for [`Role::Push`]), if `F` has that output and `∂F` reads it.
    pub fn output_grad_node(&self, role: Role) -> Option<NodeId> {
        let i = self.forward.outputs.iter().position(|o| o.role == role)?;
        self.backward.input_node(Source::OutputGrad(i))
    }
}

/// The static head: a graph over the pushed values of the head rows.
#[derive(Clone, Debug)]
pub struct Head {
    pub rows: HeadRows,
    pub forward: Graph,
    pub backward: Graph,
    pub loss: NodeId,
    pub logits: Option<NodeId>,
}

/// A declared, differentiated and classified model.
#[derive(Clone, Debug)]
pub struct Model {
    pub name: String,
    pub params: Vec<ParamSpec>,
    pub functions: Vec<VertexFunction>,
    pub selector: FunctionSelector,
    pub head: Head,
    /// Width of the scattered vertex state.
    pub state_width: usize,
    /// Free-form settings recorded in checkpoints (hidden size, vocabulary size...).
    pub settings: BTreeMap<String, String>,
}

impl Model {
    /// The vertex function that runs at a vertex of `kind` with
    /// `children` children, or why the vertex cannot be run: no function
    /// for its kind, or more or fewer children than the function reads
    /// (its [`Arity`]). The message starts with the verb ("has 3
    /// children, but ..."), for the caller to put the vertex before it.
    /// Constant time, no allocation unless the vertex is refused.
    #[inline]
    pub fn function_for(&self, kind: u16, children: usize) -> std::result::Result<usize, String> {
        arity::function_for(&self.name, &self.selector, kind, children, |f| {
            self.functions.get(f).map(|f| (f.name.as_str(), f.arity))
        })
    }
    /// The parameters whose gradient every backward pass sets row by row
    /// (embedding tables read by row lookups, and nothing else).
    pub fn row_grad_params(&self) -> BTreeSet<usize> {
        let mut dense = BTreeSet::new();
        let mut rows = BTreeSet::new();
        let graphs = self.functions.iter().map(|f| &f.backward);
        for g in graphs.chain([&self.head.backward]) {
            for o in &g.outputs {
                match o.role {
                    Role::ParamGrad(p) => {
                        dense.insert(p);
                    }
                    Role::ParamRowGrad(p) => {
                        rows.insert(p);
                    }
                    _ => {}
                }
            }
        }
        rows.difference(&dense).copied().collect()
    }
    /// Parameter names in declaration order.
    pub fn param_names(&self) -> Vec<String> {
        self.params.iter().map(|p| p.name.clone()).collect()
    }
    /// True when parameter `p` is a non-trained buffer ([`ParamKind::Buffer`]).
    pub fn is_buffer(&self, p: usize) -> bool {
        self.params
            .get(p)
            .is_some_and(|spec| spec.kind == ParamKind::Buffer)
    }
    /// The id of parameter `name`.
    pub fn param_id(&self, name: &str) -> Result<usize> {
        self.params
            .iter()
            .position(|p| p.name == name)
            .ok_or_else(|| CoreError::Unknown {
                kind: "parameter",
                name: name.to_string(),
                hint: format!(
                    " in model `{}` (has: {})",
                    self.name,
                    self.param_names().join(", ")
                ),
            })
    }
    /// A readable listing of every graph (for `ramus inspect`).
    pub fn listing(&self) -> String {
        let names = self.param_names();
        let mut s = format!("model {} (state width {})\n", self.name, self.state_width);
        for p in &self.params {
            let kind = match p.kind {
                ParamKind::Trained => "param",
                ParamKind::Buffer => "buffer",
            };
            s += &format!("{kind} {} {:?} {:?}\n", p.name, p.shape, p.init);
        }
        for f in &self.functions {
            s += &format!(
                "\nvertex function {}\n{}",
                f.name,
                f.forward.listing(&names)
            );
            s += &format!(
                "eager {:?}\nper-task {:?}\nlazy {:?}\n",
                f.forward_plan.eager, f.forward_plan.per_task, f.forward_plan.lazy
            );
            s += &format!("\n∂{}\n{}", f.name, f.backward.listing(&names));
            s += &format!(
                "eager {:?}\nper-task {:?}\nlazy {:?}\n",
                f.backward_plan.eager, f.backward_plan.per_task, f.backward_plan.lazy
            );
        }
        s += &format!(
            "\nhead ({:?})\n{}",
            self.head.rows,
            self.head.forward.listing(&names)
        );
        s += &format!("\n∂head\n{}", self.head.backward.listing(&names));
        s
    }
}

/// Builds one vertex function: a [`GraphBuilder`] plus the Cavs primitives.
pub struct VertexFnBuilder {
    b: GraphBuilder,
    state_width: usize,
    /// The smallest `k` of a `gather_optional(k)`.
    optional_from: Option<usize>,
}

impl Deref for VertexFnBuilder {
    type Target = GraphBuilder;
    fn deref(&self) -> &GraphBuilder {
        &self.b
    }
}
impl DerefMut for VertexFnBuilder {
    fn deref_mut(&mut self) -> &mut GraphBuilder {
        &mut self.b
    }
}

impl VertexFnBuilder {
    /// The scattered state of child `k`. A vertex the function runs at
    /// must have every child it gathers, or no children at all (the start
    /// of a chain, where every `gather` reads zeros); other counts are
    /// refused when the batch is scheduled ([`Model::function_for`]).
    pub fn gather(&mut self, k: usize) -> Sym {
        let w = self.state_width;
        self.b
            .input(Source::Gather(k), ValueType::rows(Space::Vertex, w))
    }
    /// [`VertexFnBuilder::gather`] of a child a vertex may lack (zeros
    /// then), with every later child: children `k..` are optional.
    pub fn gather_optional(&mut self, k: usize) -> Sym {
        self.optional_from = Some(self.optional_from.map_or(k, |o| o.min(k)));
        self.gather(k)
    }
    /// The scattered state of every child: one edge row per child, in child
    /// order. Reduce with `sum_children`.
    pub fn gather_all(&mut self) -> Sym {
        let w = self.state_width;
        self.b
            .input(Source::GatherAll, ValueType::rows(Space::Edge, w))
    }
    /// An external float input of `width` per vertex.
    pub fn pull(&mut self, width: usize) -> Sym {
        self.b
            .input(Source::Pull, ValueType::rows(Space::Vertex, width))
    }
    /// The vertex's token id.
    pub fn token(&mut self) -> Sym {
        self.b
            .input(Source::Token, ValueType::index_rows(Space::Vertex))
    }
    /// Pulls the vertex's token and looks it up in `table` (an embedding).
    pub fn embed(&mut self, table: usize) -> Sym {
        let t = self.b.param(table);
        let tok = self.token();
        self.b.embedding(t, tok)
    }
    /// Pulls the vertex's token and looks it up in `table`, tokens beyond
    /// the table reading its row 0 (the unknown word's; see
    /// [`crate::ops::EmbeddingUnk`]).
    pub fn embed_unk(&mut self, table: usize) -> Sym {
        let t = self.b.param(table);
        let tok = self.token();
        self.b.embedding_unk(t, tok)
    }
    /// Sets the vertex state that parents gather.
    pub fn scatter(&mut self, state: Sym) {
        let w = self.b.width(state);
        if !self.b.failed()
            && (w != self.state_width || self.b.ty(state).map(|t| t.space) != Some(Space::Vertex))
        {
            let sw = self.state_width;
            self.b.fail(
                "scatter",
                format!("state must be vertex rows of width {sw}, got width {w}"),
            );
            return;
        }
        self.b.output(Role::Scatter, state, None);
    }
    /// Exports a vertex value to the head.
    pub fn push(&mut self, value: Sym) {
        if self.b.ty(value).map(|t| t.space) != Some(Space::Vertex) && !self.b.failed() {
            self.b.fail("push", "pushed value must be vertex rows");
            return;
        }
        self.b.output(Role::Push, value, None);
    }
}

/// Builds the head.
pub struct HeadBuilder {
    b: GraphBuilder,
    input_width: usize,
}

impl Deref for HeadBuilder {
    type Target = GraphBuilder;
    fn deref(&self) -> &GraphBuilder {
        &self.b
    }
}
impl DerefMut for HeadBuilder {
    fn deref_mut(&mut self) -> &mut GraphBuilder {
        &mut self.b
    }
}

impl HeadBuilder {
    /// The pushed value of each head row.
    pub fn input(&mut self) -> Sym {
        let w = self.input_width;
        self.b
            .input(Source::HeadInput, ValueType::rows(Space::Vertex, w))
    }
    /// The label of each head row.
    pub fn labels(&mut self) -> Sym {
        self.b
            .input(Source::Label, ValueType::index_rows(Space::Vertex))
    }
    /// Declares the scalar loss (a static `[1]` value).
    pub fn loss(&mut self, loss: Sym) {
        if self
            .b
            .ty(loss)
            .map(|t| t.space == Space::Static && t.width() == 1)
            != Some(true)
            && !self.b.failed()
        {
            self.b.fail(
                "loss",
                "loss must be a static scalar (reduce rows with mean_rows / sum_rows)",
            );
            return;
        }
        self.b.output(Role::Loss, loss, None);
    }
    /// Declares per-row class scores (predictions take their argmax).
    pub fn logits(&mut self, scores: Sym) {
        self.b.output(Role::Logits, scores, None);
    }
}

/// Declares a [`Model`].
pub struct ModelBuilder {
    name: String,
    state_width: usize,
    params: Vec<ParamSpec>,
    /// Name, forward graph and first optional child of each function.
    functions: Vec<(String, Graph, Option<usize>)>,
    selector: Option<FunctionSelector>,
    head: Option<(HeadRows, Graph)>,
    settings: BTreeMap<String, String>,
}

impl ModelBuilder {
    /// A model whose vertex state (what `scatter` writes and `gather` reads) is `state_width` wide.
    pub fn new(name: &str, state_width: usize) -> Self {
        ModelBuilder {
            name: name.to_string(),
            state_width,
            params: Vec::new(),
            functions: Vec::new(),
            selector: None,
            head: None,
            settings: BTreeMap::new(),
        }
    }

    /// Declares a parameter and returns its id.
    pub fn param(&mut self, name: &str, shape: &[usize], init: Init) -> usize {
        self.params.push(ParamSpec {
            name: name.to_string(),
            shape: shape.to_vec(),
            init,
            kind: ParamKind::Trained,
        });
        self.params.len() - 1
    }

    /// Declares a non-trained buffer ([`ParamKind::Buffer`], e.g. a running
    /// mean) and returns its id; graphs read it with `param` like any
    /// parameter. Declaring buffers after every trained parameter keeps the
    /// trained ones contiguous (one optimizer segment on the device).
    pub fn buffer(&mut self, name: &str, shape: &[usize], init: Init) -> usize {
        self.params.push(ParamSpec {
            name: name.to_string(),
            shape: shape.to_vec(),
            init,
            kind: ParamKind::Buffer,
        });
        self.params.len() - 1
    }

    /// Records a setting (kept in checkpoints).
    pub fn setting(&mut self, key: &str, value: impl ToString) {
        self.settings.insert(key.to_string(), value.to_string());
    }

    fn shapes(&self) -> Vec<Vec<usize>> {
        self.params.iter().map(|p| p.shape.clone()).collect()
    }

    /// Declares a vertex function and returns its index.
    pub fn vertex_fn(
        &mut self,
        name: &str,
        body: impl FnOnce(&mut VertexFnBuilder),
    ) -> Result<usize> {
        let context = format!("model `{}`, vertex function `{name}`", self.name);
        let mut f = VertexFnBuilder {
            b: GraphBuilder::new(&context, &self.shapes()),
            state_width: self.state_width,
            optional_from: None,
        };
        body(&mut f);
        let optional_from = f.optional_from;
        let graph = f.b.finish()?;
        self.functions
            .push((name.to_string(), graph, optional_from));
        Ok(self.functions.len() - 1)
    }

    /// Chooses which function runs where (default: the single declared function).
    pub fn select(&mut self, selector: FunctionSelector) {
        self.selector = Some(selector);
    }

    /// Declares the head, attached to `rows`, over values of `input_width`.
    pub fn head(
        &mut self,
        rows: HeadRows,
        input_width: usize,
        body: impl FnOnce(&mut HeadBuilder),
    ) -> Result<()> {
        let context = format!("model `{}`, head", self.name);
        let mut h = HeadBuilder {
            b: GraphBuilder::new(&context, &self.shapes()),
            input_width,
        };
        body(&mut h);
        self.head = Some((rows, h.b.finish()?));
        Ok(())
    }

    /// Validates, differentiates (turning the pad-and-add gradients of column
    /// slices into concats, [`pads_to_concat`]) and classifies everything.
    pub fn build(self) -> Result<Model> {
        let err = |m: String| CoreError::model(&self.name, m);
        if self.functions.is_empty() {
            return Err(err("declares no vertex function".into()));
        }
        let selector = self.checked_selector()?;
        let (rows, head_graph) = self
            .head
            .clone()
            .ok_or_else(|| err("declares no head".into()))?;
        let shapes = self.shapes();
        let mut functions = Vec::new();
        let mut push_width = None;
        for (name, forward, optional_from) in &self.functions {
            let f =
                self.vertex_function(name, forward, *optional_from, &shapes, &mut push_width)?;
            functions.push(f);
        }
        let head_input = head_graph.input_node(Source::HeadInput);
        if let (Some(n), Some(w)) = (head_input, push_width) {
            if head_graph.nodes[n].ty.width() != w {
                return Err(err(format!(
                    "head reads width {} but vertex functions push width {w}",
                    head_graph.nodes[n].ty.width()
                )));
            }
        }
        let loss = head_graph
            .output(Role::Loss)
            .map(|o| o.node)
            .ok_or_else(|| err("head declares no loss".into()))?;
        let logits = head_graph.output(Role::Logits).map(|o| o.node);
        let head_backward = pads_to_concat(&differentiate(
            &head_graph,
            &shapes,
            &format!("{}/head", self.name),
        )?)?;
        Ok(Model {
            name: self.name.clone(),
            params: self.params.clone(),
            functions,
            selector,
            head: Head {
                rows,
                forward: head_graph,
                backward: head_backward,
                loss,
                logits,
            },
            state_width: self.state_width,
            settings: self.settings.clone(),
        })
    }

    /// The selector (a single function needs none), checked against the
    /// functions declared.
    fn checked_selector(&self) -> Result<FunctionSelector> {
        let err = |m: String| CoreError::model(&self.name, m);
        let selector = match self.selector.clone() {
            Some(s) => s,
            None if self.functions.len() == 1 => FunctionSelector::Single(0),
            None => {
                return Err(err(
                    "declares several vertex functions but no selector".into()
                ))
            }
        };
        let used = selector.functions();
        if used.is_empty() {
            return Err(err("the selector's kind table is empty".into()));
        }
        if u16::try_from(used.len() - 1).is_err() {
            return Err(err(format!(
                "the selector's kind table has {} entries; kinds are u16",
                used.len()
            )));
        }
        if let Some(&bad) = used.iter().find(|&&f| f >= self.functions.len()) {
            return Err(err(format!(
                "selector names function {bad}, but only {} exist",
                self.functions.len()
            )));
        }
        Ok(selector)
    }

    /// Vertex function `name`: checked (it pushes a value of the width
    /// `push_width` of the functions before it, or sets that width; it
    /// scatters a state if it gathers children), differentiated and
    /// classified.
    fn vertex_function(
        &self,
        name: &str,
        forward: &Graph,
        optional_from: Option<usize>,
        shapes: &[Vec<usize>],
        push_width: &mut Option<usize>,
    ) -> Result<VertexFunction> {
        let err = |m: String| CoreError::model(&self.name, m);
        let context = format!("{}/{name}", self.name);
        let scatter = forward.output(Role::Scatter).map(|o| o.node);
        let push = forward.output(Role::Push).map(|o| o.node);
        let Some(push_node) = push else {
            return Err(err(format!(
                "vertex function `{name}` never pushes a value for the head"
            )));
        };
        let w = forward.nodes[push_node].ty.width();
        if *push_width.get_or_insert(w) != w {
            return Err(err(format!(
                "vertex functions push values of different widths ({w} in `{name}`)"
            )));
        }
        let gather_arity = forward
            .nodes
            .iter()
            .filter_map(|n| match n.kind {
                crate::graph::NodeKind::Input(Source::Gather(k)) => Some(k + 1),
                _ => None,
            })
            .max()
            .unwrap_or(0);
        let arity = Arity::of(forward, optional_from);
        let reads_children = arity != Arity::Fixed { min: 0, max: 0 };
        if reads_children && scatter.is_none() {
            return Err(err(format!(
                "vertex function `{name}` gathers children but never scatters a state"
            )));
        }
        // the gradients of column slices (pads summed) become concats
        let backward = pads_to_concat(&differentiate(forward, shapes, &context)?)?;
        let forward_plan = classify(
            forward,
            |s| matches!(s, Source::Gather(_) | Source::GatherAll),
            |r| r == Role::Scatter,
            &context,
        )?;
        let scatter_output = forward.outputs.iter().position(|o| o.role == Role::Scatter);
        let backward_plan = classify(
            &backward,
            |s| Some(s) == scatter_output.map(Source::OutputGrad),
            |r| matches!(r, Role::ChildGrad(_) | Role::ChildGradAll),
            &format!("∂{context}"),
        )?;
        Ok(VertexFunction {
            name: name.to_string(),
            forward: forward.clone(),
            backward,
            forward_plan,
            backward_plan,
            scatter,
            push,
            gather_arity,
            arity,
        })
    }
}
