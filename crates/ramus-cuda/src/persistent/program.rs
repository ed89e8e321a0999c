//! Set-up of a model for the persistent engine: the fusion plans of every
//! graph (as the batched engine plans them, minus the kernels), the model's
//! fused groups as `case`s of the persistent kernel, which parameters are
//! register-cached matrices, and where every parameter, gradient and
//! optimizer moment lives in the pool.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use ramus_codegen::fused::FusedSource;
use ramus_core::fusion::{self, InputKind, Step};
use ramus_core::graph::{Graph, NodeId, NodeKind, Role, Source};
use ramus_core::op::OpDef;
use ramus_core::ops::Op;
use ramus_core::vpps::MatrixSpec;
use ramus_core::Model;

use crate::error::{CudaError, Result};
use crate::program::{op_nodes, plan_graph, PlannedGraph};

/// Which graph of the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum GraphKey {
    /// Vertex function `f`'s `F`.
    Forward(usize),
    /// Vertex function `f`'s `∂F`.
    Backward(usize),
    HeadForward,
    HeadBackward,
}

impl GraphKey {
    /// The vertex function whose rows the graph runs over (none: the head's).
    pub fn function(self) -> Option<usize> {
        match self {
            GraphKey::Forward(f) | GraphKey::Backward(f) => Some(f),
            GraphKey::HeadForward | GraphKey::HeadBackward => None,
        }
    }

    /// The graph itself.
    pub fn graph(self, model: &Model) -> &Graph {
        match self {
            GraphKey::Forward(f) => &model.functions[f].forward,
            GraphKey::Backward(f) => &model.functions[f].backward,
            GraphKey::HeadForward => &model.head.forward,
            GraphKey::HeadBackward => &model.head.backward,
        }
    }

    /// Position of the graph in per-graph tables of a model with
    /// `functions` vertex functions: `F`s, `∂F`s, the head, its backward.
    pub fn index(self, functions: usize) -> usize {
        match self {
            GraphKey::Forward(f) => f,
            GraphKey::Backward(f) => functions + f,
            GraphKey::HeadForward => 2 * functions,
            GraphKey::HeadBackward => 2 * functions + 1,
        }
    }

    /// Entries of a per-graph table (see [`GraphKey::index`]) of a model
    /// with `functions` vertex functions.
    pub fn table_len(functions: usize) -> usize {
        2 * functions + 2
    }

    /// The forward graph a backward graph's `Forward(m)` inputs name.
    pub fn forward_of(self) -> Option<GraphKey> {
        match self {
            GraphKey::Backward(f) => Some(GraphKey::Forward(f)),
            GraphKey::HeadBackward => Some(GraphKey::HeadForward),
            _ => None,
        }
    }
}

/// Where each parameter lives in the pool (float offsets) and how it is
/// updated.
#[derive(Clone, Debug, Default)]
pub(crate) struct ParamLayout {
    pub value: Vec<usize>,
    /// Gradient accumulator (a register-cached matrix uses it only when
    /// its gradient does not fit in registers).
    pub grad: Vec<Option<usize>>,
    pub first: Vec<usize>,
    pub second: Vec<usize>,
    pub len: Vec<usize>,
    /// Floats the parameter region takes (the batch's values follow).
    pub total: usize,
}

/// Everything the persistent engine derives from the model once.
pub(crate) struct PersistentProgram {
    /// Vertex functions of the model (sizes the per-graph tables).
    pub functions: usize,
    /// Plans by [`GraphKey::index`].
    plans: Vec<PlannedGraph>,
    /// Case of each fused step, by graph index, phase and step index.
    cases: Vec<Vec<Vec<Option<u16>>>>,
    /// Each graph's slice views by node (the plans' maps, indexed).
    views: Vec<Vec<Option<ramus_core::fusion::SliceView>>>,
    /// Per graph: products whose lone bias add runs as their epilogue,
    /// `product → (add, bias)`; the add's fused step is skipped.
    epilogues: Vec<HashMap<NodeId, (NodeId, NodeId)>>,
    /// Per graph, by node: edge values bound to their vertex (see
    /// [`Self::vertex_bound`]).
    vertex_bound: Vec<Vec<bool>>,
    /// Per graph, by node: what a forward product writes (see
    /// [`Self::forward_product_output`]).
    forward_product_outputs: Vec<Vec<bool>>,
    /// Per graph: the sums over children's gathered states that the
    /// children push (see [`Self::pushed_sum`]), node → first column.
    pushed_sums: Vec<BTreeMap<NodeId, usize>>,
    /// Per graph: its child gradients if its fused groups add them into the
    /// children's gradient rows themselves (see
    /// [`Self::scattered_child_grads`]).
    scattered_child_grads: Vec<Option<NodeId>>,
    /// Per graph and node, where its rows are stored (see
    /// [`Self::stored`]).
    stored: Vec<Vec<(GraphKey, NodeId)>>,
    /// The cases' CUDA source (one `case` block each).
    pub fused_source: String,
    /// Per parameter: its register-cached matrix, if it is one.
    pub cached: Vec<Option<u16>>,
    pub matrices: Vec<MatrixSpec>,
    pub params: ParamLayout,
    /// Parameters whose gradient arrives as rows at token indices only.
    pub row_grad_params: BTreeSet<usize>,
}

fn unsupported(message: impl Into<String>) -> CudaError {
    CudaError::Model(format!(
        "the persistent engine cannot run this model: {}",
        message.into()
    ))
}

/// The keys of every graph of `model`, in execution order.
pub(crate) fn graph_keys(model: &Model) -> Vec<GraphKey> {
    let n = model.functions.len();
    let mut keys: Vec<GraphKey> = (0..n).map(GraphKey::Forward).collect();
    keys.push(GraphKey::HeadForward);
    keys.push(GraphKey::HeadBackward);
    keys.extend((0..n).map(GraphKey::Backward));
    keys
}

/// Every graph's plan (its phases' steps and fused groups), indexed by
/// [`GraphKey::index`].
fn plan_graphs(model: &Model) -> Result<Vec<PlannedGraph>> {
    let mut plans = HashMap::new();
    let mut kernels = std::collections::BTreeMap::new();
    let none = BTreeSet::new();
    for (f, func) in model.functions.iter().enumerate() {
        let keep = persistent_keep(&func.forward, &func.backward);
        let fp = &func.forward_plan;
        let phases = [fp.eager.clone(), fp.per_task.clone(), fp.lazy.clone()];
        plans.insert(
            GraphKey::Forward(f),
            plan_graph(&func.forward, &phases, &keep, &mut kernels)?,
        );
        let bp = &func.backward_plan;
        let phases = [bp.eager.clone(), bp.per_task.clone(), bp.lazy.clone()];
        let mut backward = plan_graph(&func.backward, &phases, &none, &mut kernels)?;
        let forward_views = &plans[&GraphKey::Forward(f)].views;
        read_forward_views_as_windows(&func.backward, &mut backward, forward_views)?;
        plans.insert(GraphKey::Backward(f), backward);
    }
    let head = &model.head;
    let keep = fusion::forward_reads(&head.backward);
    plans.insert(
        GraphKey::HeadForward,
        plan_graph(
            &head.forward,
            &[op_nodes(&head.forward, |_| true)],
            &keep,
            &mut kernels,
        )?,
    );
    plans.insert(
        GraphKey::HeadBackward,
        plan_graph(
            &head.backward,
            &[op_nodes(&head.backward, |_| true)],
            &none,
            &mut kernels,
        )?,
    );

    let n = model.functions.len();
    let mut keyed: Vec<(usize, PlannedGraph)> =
        plans.into_iter().map(|(k, p)| (k.index(n), p)).collect();
    keyed.sort_by_key(|(i, _)| *i);
    let plans: Vec<PlannedGraph> = keyed.into_iter().map(|(_, p)| p).collect();
    Ok(plans)
}

/// Per graph, phase and step: the fused group's case (`None`: not a fused
/// group).
type FusedCases = Vec<Vec<Vec<Option<u16>>>>;

/// Each fused group's case number in the persistent kernel (one case per
/// distinct group body: `cases[graph][phase][step]`) and the cases' source.
/// `scattered_child_grads`: per graph, the child gradients its groups add into the
/// children's rows themselves.
fn fused_cases(
    model: &Model,
    plans: &[PlannedGraph],
    scattered_child_grads: &[Option<NodeId>],
) -> Result<(FusedCases, String)> {
    let n = model.functions.len();
    let mut cases: Vec<Vec<Vec<Option<u16>>>> = plans
        .iter()
        .map(|p| {
            p.phases
                .iter()
                .map(|ph| vec![None; ph.steps.len()])
                .collect()
        })
        .collect();
    let mut bodies: HashMap<String, u16> = HashMap::new();
    let mut fused_source = String::new();
    for key in graph_keys(model) {
        let g = key.graph(model);
        for (phase, plan) in plans[key.index(n)].phases.iter().enumerate() {
            for (i, step) in plan.steps.iter().enumerate() {
                let Step::Fused(group) = step else { continue };
                let scattered = scattered_child_grads[key.index(n)];
                let scatter_added = |concat: NodeId| Some(concat) == scattered;
                let body = group.persistent_case(g, 0, &scatter_added)?;
                let next = u16::try_from(bodies.len())
                    .map_err(|_| unsupported("more than 65536 fused groups"))?;
                let case = *bodies.entry(body).or_insert_with(|| {
                    // the body was generated for case 0; renumber
                    next
                });
                if case == next {
                    fused_source += &group.persistent_case(g, usize::from(case), &scatter_added)?;
                }
                cases[key.index(n)][phase][i] = Some(case);
            }
        }
    }
    Ok((cases, fused_source))
}

/// Where each parameter, its gradient and its optimizer moments lie in the
/// pool's parameter region.
fn param_layout(model: &Model) -> ParamLayout {
    let mut params = ParamLayout::default();
    let mut at = 0;
    for spec in &model.params {
        let len: usize = spec.shape.iter().product();
        params.len.push(len);
        params.value.push(at);
        at += len;
        // cached matrices too: their gradients land here when they do
        // not fit in registers (VPPS §III-C2)
        params.grad.push(Some(at));
        at += len;
        params.first.push(at);
        at += len;
        params.second.push(at);
        at += len;
    }
    params.total = at;
    params
}

impl PersistentProgram {
    pub fn build(model: &Model) -> Result<Self> {
        let plans = plan_graphs(model)?;
        let n = model.functions.len();
        let mut scattered_child_grads = vec![None; plans.len()];
        for f in 0..n {
            let key = GraphKey::Backward(f);
            scattered_child_grads[key.index(n)] =
                child_grads_written_in_place(key.graph(model), &plans[key.index(n)]);
        }
        let (cases, fused_source) = fused_cases(model, &plans, &scattered_child_grads)?;

        // plans are indexed by graph; so are their views, by node
        let mut views = vec![Vec::new(); plans.len()];
        for key in graph_keys(model) {
            let plan = &plans[key.index(n)];
            views[key.index(n)] = (0..key.graph(model).nodes.len())
                .map(|x| plan.views.get(&x).copied())
                .collect();
        }
        let (cached, matrices) = cached_matrices(model)?;
        let mut epilogues = vec![HashMap::new(); plans.len()];
        for key in graph_keys(model) {
            let keep = match key {
                GraphKey::Forward(f) => fusion::forward_reads(&model.functions[f].backward),
                GraphKey::HeadForward => fusion::forward_reads(&model.head.backward),
                _ => BTreeSet::new(),
            };
            epilogues[key.index(n)] =
                bias_epilogues(key.graph(model), &plans[key.index(n)], &cached, &keep);
        }
        let mut vertex_bound = vec![Vec::new(); plans.len()];
        let mut forward_product_outputs = vec![Vec::new(); plans.len()];
        let mut pushed_sums = vec![BTreeMap::new(); plans.len()];
        for key in graph_keys(model) {
            let i = key.index(n);
            vertex_bound[i] = vertex_bound_edges(key.graph(model), &plans[i], &epilogues[i]);
            forward_product_outputs[i] =
                forward_product_writes(key.graph(model), &cached, &epilogues[i]);
            if let GraphKey::Forward(_) = key {
                pushed_sums[i] = sums_of_gathered_states(key.graph(model), &plans[i]);
            }
        }
        let row_grad_params = model.row_grad_params();
        let params = param_layout(model);
        let mut prog = PersistentProgram {
            stored: Vec::new(),
            functions: n,
            plans,
            views,
            epilogues,
            vertex_bound,
            forward_product_outputs,
            pushed_sums,
            scattered_child_grads,
            cases,
            fused_source,
            cached,
            matrices,
            params,
            row_grad_params,
        };
        prog.stored = storage_table(model, &prog);
        Ok(prog)
    }

    /// `(graph, node)` where node `n` of graph `key` has its rows: after
    /// `Forward(m)` inputs and slice views.
    pub fn stored(&self, key: GraphKey, n: NodeId) -> (GraphKey, NodeId) {
        self.stored[key.index(self.functions)][n]
    }

    /// The plan of graph `key`.
    pub fn plan(&self, key: GraphKey) -> &PlannedGraph {
        &self.plans[key.index(self.functions)]
    }

    /// The slice view node `n` of graph `key` is, if it is one.
    pub fn view(&self, key: GraphKey, n: NodeId) -> Option<&ramus_core::fusion::SliceView> {
        self.views[key.index(self.functions)].get(n)?.as_ref()
    }

    /// The `(add, bias)` a product of graph `key` adds in its epilogue.
    pub fn epilogue(&self, key: GraphKey, product: NodeId) -> Option<(NodeId, NodeId)> {
        self.epilogues[key.index(self.functions)]
            .get(&product)
            .copied()
    }

    /// True if fused step `group` of graph `key` is a product's epilogue
    /// (it has no instruction of its own).
    pub fn is_epilogue(&self, key: GraphKey, group: &ramus_core::fusion::FusedGroup) -> bool {
        let [add] = group.nodes[..] else {
            return false;
        };
        self.epilogues[key.index(self.functions)]
            .values()
            .any(|&(a, _)| a == add)
    }

    /// True if a member of fused group `group` of graph `key` is an edge
    /// value bound to its vertex: summed into the vertex in the graph, or
    /// computed from the vertex's own (not a product's) value. Such a
    /// group's instructions are cut at vertex boundaries.
    pub fn vertex_bound(&self, key: GraphKey, group: &ramus_core::fusion::FusedGroup) -> bool {
        let bound = &self.vertex_bound[key.index(self.functions)];
        group
            .nodes
            .iter()
            .any(|&x| bound.get(x).copied().unwrap_or(false))
    }

    /// True if node `n` of graph `key` is what a forward product `x Wᵀ`
    /// with a register-cached `W` writes (the product, or the add of its
    /// bias epilogue): a wide instruction may split the product's reduction
    /// over processors that add their partial sums atomically (see
    /// `ramus_core::vpps::wide_tiles`), so it starts at zero.
    pub fn forward_product_output(&self, key: GraphKey, n: NodeId) -> bool {
        self.forward_product_outputs[key.index(self.functions)]
            .get(n)
            .copied()
            .unwrap_or(false)
    }

    /// The first column of the children's states that `sum_children` node
    /// `n` of graph `key` sums, if the children push it: a sum of the
    /// gathered states (or of a slice of them) computed as its own step.
    /// Each child then adds its columns into its parent's row right after
    /// it scattered its state (an atomic row add that runs in the child's
    /// chain of instructions), so the sum is complete when the children
    /// are, and the parent's products that read it run a level earlier than
    /// behind a sum of their own that waits for children finished by
    /// different processors.
    pub fn pushed_sum(&self, key: GraphKey, n: NodeId) -> Option<usize> {
        self.pushed_sums[key.index(self.functions)].get(&n).copied()
    }

    /// Every pushed sum of graph `key` (see [`Self::pushed_sum`]) with its
    /// first column, in node order.
    pub fn pushed_sums(&self, key: GraphKey) -> impl Iterator<Item = (NodeId, usize)> + '_ {
        self.pushed_sums[key.index(self.functions)]
            .iter()
            .map(|(&n, &column)| (n, column))
    }

    /// The child gradients (`ChildGradAll` output) of backward graph
    /// `key` if the fused groups that compute them add them into the
    /// children's state-gradient rows themselves (an atomic add per element
    /// at the row an index array gives) instead of into the concat's own
    /// rows, which a row scatter-add then sends on: the output is a concat
    /// written in place that nothing else reads.
    pub fn scattered_child_grads(&self, key: GraphKey) -> Option<NodeId> {
        self.scattered_child_grads[key.index(self.functions)]
    }

    /// The case of fused step `step` of phase `phase` of graph `key`.
    pub fn case(&self, key: GraphKey, phase: usize, step: usize) -> Result<u16> {
        self.cases[key.index(self.functions)]
            .get(phase)
            .and_then(|p| p.get(step).copied().flatten())
            .ok_or_else(|| {
                unsupported(format!(
                    "step {step} of phase {phase} of {key:?} is not a fused group"
                ))
            })
    }
}

/// The forward values of a vertex function that its `∂F` reads and that the
/// plan of `F` must give buffers of their own: all of them
/// ([`fusion::forward_reads`]) but slices that every reader in `∂F` reads
/// in place, as a product's operand or, through
/// [`read_forward_views_as_windows`], as an input of a fused group of
/// their width. A batch's values all live until its end in the persistent
/// engine, so such a slice can stay a view of its source: a Tree-LSTM's
/// children's `h` and `c`, read from the gathered states, cost no copy per
/// level.
fn persistent_keep(forward: &Graph, backward: &Graph) -> BTreeSet<NodeId> {
    let mut keep = fusion::forward_reads(backward);
    keep.retain(|&m| {
        if !matches!(forward.nodes[m].op(), Some(Op::Slice(_))) {
            return true;
        }
        let read_in_place = |input: NodeId| {
            let ty = &backward.nodes[input].ty;
            backward
                .nodes
                .iter()
                .enumerate()
                .filter(|(_, u)| u.inputs.contains(&input))
                .all(|(u, node)| match node.op() {
                    Some(op) if op.elementwise_template().is_some() => {
                        node.ty.space == ty.space && node.ty.width() == ty.width()
                    }
                    Some(_) => {
                        node.matmul().is_some() && fusion::reads_in_place(backward, u, input, false)
                    }
                    None => false,
                })
        };
        let in_place = backward.nodes.iter().enumerate().all(|(i, node)| {
            !matches!(node.kind, NodeKind::Input(Source::Forward(x)) if x == m)
                || (!backward.outputs.iter().any(|o| o.node == i) && read_in_place(i))
        });
        !in_place
    });
    keep
}

/// Makes `∂F`'s fused groups read the forward values that `F`'s plan left
/// as views (`forward_views`, see [`persistent_keep`]) as windows of the
/// view's source rows: element `i` of such an input is at `(i / width) ·
/// stride + i % width` from the row the instruction names (the lowering
/// locates a view's rows, its first column included). Errors if a group
/// reads one otherwise (by a row topology or as a broadcast), which
/// `persistent_keep` does not let happen.
fn read_forward_views_as_windows(
    backward: &Graph,
    plan: &mut PlannedGraph,
    forward_views: &HashMap<NodeId, fusion::SliceView>,
) -> Result<()> {
    for phase in &mut plan.phases {
        for step in &mut phase.steps {
            let Step::Fused(group) = step else { continue };
            for input in &mut group.inputs {
                let NodeKind::Input(Source::Forward(m)) = backward.nodes[input.node].kind else {
                    continue;
                };
                let Some(view) = forward_views.get(&m) else {
                    continue;
                };
                if input.kind != InputKind::PerElement {
                    return Err(unsupported(format!(
                        "a fused group of a backward graph reads the forward view %{m} as {:?}",
                        input.kind
                    )));
                }
                input.kind = InputKind::Window {
                    source: input.node,
                    offset: 0,
                    stride: view.stride,
                };
            }
        }
    }
    Ok(())
}

/// The `ChildGradAll` output of a vertex function's `∂F` if `plan` writes
/// it in place from fused groups and the graph reads it nowhere (see
/// [`PersistentProgram::scattered_child_grads`]).
fn child_grads_written_in_place(g: &Graph, plan: &PlannedGraph) -> Option<NodeId> {
    let out = g
        .outputs
        .iter()
        .find(|o| o.role == Role::ChildGradAll)?
        .node;
    let in_place = plan
        .phases
        .iter()
        .any(|p| p.in_place_concats.contains(&out));
    let read = g.nodes.iter().any(|x| x.inputs.contains(&out));
    let once = g.outputs.iter().filter(|o| o.node == out).count() == 1;
    (in_place && !read && once).then_some(out)
}

/// `sum_children` steps of a vertex function's `F` (see
/// [`PersistentProgram::pushed_sum`]) whose operand is the gathered
/// children's states or a slice of them, with the slice's first column.
fn sums_of_gathered_states(g: &Graph, plan: &PlannedGraph) -> BTreeMap<NodeId, usize> {
    let stepped: BTreeSet<NodeId> = plan
        .phases
        .iter()
        .flat_map(|p| p.steps.iter())
        .filter_map(|step| match step {
            Step::Op(n) => Some(*n),
            Step::Fused(_) => None,
        })
        .collect();
    let gathered = |x: NodeId| matches!(g.nodes[x].kind, NodeKind::Input(Source::GatherAll));
    stepped
        .into_iter()
        .filter(|&n| g.nodes[n].op().is_some_and(Op::is_child_sum))
        .filter_map(|n| {
            let x = *g.nodes[n].inputs.first()?;
            if gathered(x) {
                return Some((n, 0));
            }
            let Some(Op::Slice(slice)) = g.nodes[x].op() else {
                return None;
            };
            gathered(*g.nodes[x].inputs.first()?).then_some((n, slice.start))
        })
        .collect()
}

/// By node of `g`: edge values summed into their vertex (read by a
/// `sum_children`, or inline as a fused group's child sum), and members of
/// fused groups that read their vertex's value (inline `expand_children`)
/// where that value is not a product's. Their edges and the vertex are best
/// computed by one processor in one chain: the edges' work follows the
/// vertex's or precedes it. (An edge group fed by products alone fans out
/// to the children instead; it keeps its own cuts.)
fn vertex_bound_edges(
    g: &Graph,
    plan: &PlannedGraph,
    epilogues: &HashMap<NodeId, (NodeId, NodeId)>,
) -> Vec<bool> {
    let mut bound = vec![false; g.nodes.len()];
    for node in &g.nodes {
        if node.op().is_some_and(Op::is_child_sum) {
            if let Some(&x) = node.inputs.first() {
                bound[x] = true;
            }
        }
    }
    let is_product =
        |x: NodeId| g.nodes[x].matmul().is_some() || epilogues.values().any(|&(add, _)| add == x);
    for phase in &plan.phases {
        for step in &phase.steps {
            let Step::Fused(group) = step else { continue };
            for input in &group.inputs {
                match input.kind {
                    InputKind::ChildSum { source } => bound[source] = true,
                    InputKind::ParentRow { source } if !is_product(source) => {
                        for &x in &group.nodes {
                            bound[x] = true;
                        }
                    }
                    _ => {}
                }
            }
        }
    }
    for (x, node) in g.nodes.iter().enumerate() {
        bound[x] &= node.ty.space == ramus_core::graph::Space::Edge;
    }
    bound
}

/// By node of `g`: the nodes forward products `x Wᵀ` with a
/// register-cached `W` write (see
/// [`PersistentProgram::forward_product_output`]).
fn forward_product_writes(
    g: &Graph,
    cached: &[Option<u16>],
    epilogues: &HashMap<NodeId, (NodeId, NodeId)>,
) -> Vec<bool> {
    let mut writes = vec![false; g.nodes.len()];
    for (n, node) in g.nodes.iter().enumerate() {
        let product = node.matmul().is_some_and(|mm| mm.trans_b && !mm.trans_a)
            && matches!(
                node.inputs.get(1).map(|&w| &g.nodes[w].kind),
                Some(NodeKind::Param(p)) if cached[*p].is_some()
            );
        if product {
            writes[epilogues.get(&n).map_or(n, |&(add, _)| add)] = true;
        }
    }
    writes
}

/// The parameters to keep in registers: every 2-D parameter whose every
/// use is as the static right operand of a product with row values (`x Wᵀ`
/// forward, `dy W` backward) and whose gradient comes from products `dyᵀ x`
/// alone. Any other use of a 2-D parameter in a product is refused.
fn cached_matrices(model: &Model) -> Result<(Vec<Option<u16>>, Vec<MatrixSpec>)> {
    let graphs: Vec<&Graph> = model
        .functions
        .iter()
        .flat_map(|f| [&f.forward, &f.backward])
        .chain([&model.head.forward, &model.head.backward])
        .collect();
    let mut product_operand = vec![false; model.params.len()];
    let mut other_use = vec![false; model.params.len()];
    for g in &graphs {
        for node in &g.nodes {
            for (i, &x) in node.inputs.iter().enumerate() {
                let NodeKind::Param(p) = g.nodes[x].kind else {
                    continue;
                };
                let as_weight = node.matmul().is_some_and(|mm| {
                    i == 1 && !mm.trans_a && g.nodes[node.inputs[0]].ty.is_rows()
                });
                if as_weight {
                    product_operand[p] = true;
                } else {
                    other_use[p] = true;
                }
            }
        }
        for o in &g.outputs {
            if let Role::ParamGrad(p) = o.role {
                let from_product = g.nodes[o.node]
                    .matmul()
                    .is_some_and(|mm| mm.trans_a && !mm.trans_b);
                if !from_product {
                    other_use[p] = true;
                }
            }
        }
    }
    let mut cached = vec![None; model.params.len()];
    let mut matrices = Vec::new();
    for (p, spec) in model.params.iter().enumerate() {
        if !product_operand[p] {
            continue;
        }
        if other_use[p] || spec.shape.len() != 2 {
            return Err(unsupported(format!(
                "parameter `{}` ({:?}) is a product's weight but also used otherwise; \
                 only weights used solely in products can stay in registers",
                spec.name, spec.shape
            )));
        }
        cached[p] = Some(
            u16::try_from(matrices.len()).map_err(|_| unsupported("more than 65536 matrices"))?,
        );
        matrices.push(MatrixSpec {
            param: p,
            rows: spec.shape[0],
            cols: spec.shape[1],
        });
    }
    Ok((cached, matrices))
}

/// [`PersistentProgram::stored`] for every node of every graph of `model`.
fn storage_table(model: &Model, prog: &PersistentProgram) -> Vec<Vec<(GraphKey, NodeId)>> {
    fn resolve(
        model: &Model,
        prog: &PersistentProgram,
        key: GraphKey,
        n: NodeId,
    ) -> (GraphKey, NodeId) {
        if let NodeKind::Input(Source::Forward(m)) = key.graph(model).nodes[n].kind {
            if let Some(fk) = key.forward_of() {
                return resolve(model, prog, fk, m);
            }
        }
        match storage_node(prog, key, n) {
            stored if stored != n => resolve(model, prog, key, stored),
            _ => (key, n),
        }
    }
    let mut table = vec![Vec::new(); GraphKey::table_len(prog.functions)];
    for key in graph_keys(model) {
        table[key.index(prog.functions)] = (0..key.graph(model).nodes.len())
            .map(|n| resolve(model, prog, key, n))
            .collect();
    }
    table
}

/// The node a fused-group or op input reads its rows from: a viewed slice's
/// source, else the node itself.
fn storage_node(prog: &PersistentProgram, key: GraphKey, n: NodeId) -> NodeId {
    prog.view(key, n).map_or(n, |v| v.source)
}

/// Products `x Wᵀ` (with a register-cached `W`) whose only reader is a
/// fused group that is nothing but `add(product, bias)` with a bias
/// parameter, in the same phase: the product writes the add's rows with
/// the bias added (`product → (add, bias)`). Products read elsewhere, kept
/// for the backward (`keep`) or graph outputs stay as they are.
fn bias_epilogues(
    g: &Graph,
    plan: &PlannedGraph,
    cached: &[Option<u16>],
    keep: &BTreeSet<NodeId>,
) -> HashMap<NodeId, (NodeId, NodeId)> {
    let users = g.users();
    let outputs = g.output_mask();
    let mut found = HashMap::new();
    for phase in &plan.phases {
        let products: BTreeSet<NodeId> = phase
            .steps
            .iter()
            .filter_map(|s| match s {
                Step::Op(n) => Some(*n),
                Step::Fused(_) => None,
            })
            .collect();
        for step in &phase.steps {
            let Step::Fused(group) = step else { continue };
            let [add] = group.nodes[..] else { continue };
            if !matches!(g.nodes[add].op(), Some(Op::Add(_)))
                || group.outputs != [add]
                || !group.concat_writes.is_empty()
            {
                continue;
            }
            let [i0, i1] = group.inputs[..] else { continue };
            let (product, bias) = match (i0.kind, i1.kind) {
                (InputKind::PerElement, InputKind::Broadcast) => (i0.node, i1.node),
                (InputKind::Broadcast, InputKind::PerElement) => (i1.node, i0.node),
                _ => continue,
            };
            let weight_cached = g.nodes[product].matmul().is_some_and(|mm| {
                !mm.trans_a
                    && mm.trans_b
                    && matches!(g.nodes[g.nodes[product].inputs[1]].kind,
                        NodeKind::Param(p) if cached[p].is_some())
            });
            let bias_param = matches!(g.nodes[bias].kind, NodeKind::Param(_));
            let only_reader =
                users[product] == [add] && !outputs[product] && !keep.contains(&product);
            if weight_cached && bias_param && only_reader && products.contains(&product) {
                found.insert(product, (add, bias));
            }
        }
    }
    found
}
