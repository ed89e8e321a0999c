//! Set-up of a model for the CUDA batched engine: the Fusion pass over every
//! phase of every graph (vertex functions' `F` and `∂F`, the head and its
//! backward), CodeGen of one kernel per fused group from the ops' registered
//! templates, and one NVRTC compilation of all of them through the kernel
//! cache (a second process start compiles nothing).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;

use cudarc::driver::CudaFunction;

use ramus_codegen::fused::FusedSource;
use ramus_core::fusion::{self, FusedGroup, InputKind, SliceView, Step};
use ramus_core::graph::{Graph, NodeId, NodeKind};
use ramus_core::ops::Op;
use ramus_core::Model;

use crate::cache::KernelCache;
use crate::error::{CudaError, Result};

/// One step of a phase, as planned (no device needed): a non-elementwise
/// op, or a fused elementwise group.
#[derive(Clone, Debug)]
pub(crate) enum PlannedStep {
    Op(NodeId),
    Fused(FusedGroup),
    /// `add(matmul(A, Bᵀ), bias)` where the add is a fused group of its
    /// own and nothing else reads the product: over few rows one
    /// small-product launch computes both (the bias in its epilogue), over
    /// more the matmul (cuBLAS) then the group's kernel.
    GemmBias {
        matmul: NodeId,
        bias: NodeId,
        group: FusedGroup,
    },
}

impl PlannedStep {
    /// The fused group whose kernel the step launches, if any.
    pub(crate) fn group(&self) -> Option<&FusedGroup> {
        match self {
            PlannedStep::Op(_) => None,
            PlannedStep::Fused(group) | PlannedStep::GemmBias { group, .. } => Some(group),
        }
    }
}

/// A planned step with its compiled kernel (fused groups; `None` until
/// [`Program::build`] compiles them, and for plain ops).
pub(crate) struct ExecStep {
    pub step: PlannedStep,
    pub kernel: Option<CudaFunction>,
}

impl ExecStep {
    /// The step's fused kernel.
    pub(crate) fn kernel(&self) -> Result<&CudaFunction> {
        self.kernel
            .as_ref()
            .ok_or_else(|| CudaError::KernelNotFound {
                name: "(a fused group planned without a device)".into(),
            })
    }
}

/// A graph's phases as executable steps, and which nodes need a buffer
/// (members of a fused group that nothing outside reads live only in
/// registers).
pub(crate) struct GraphProgram {
    pub phases: Vec<Vec<ExecStep>>,
    pub materialized: Vec<bool>,
    /// Slices with no step, read in place (by fused groups as windows, by
    /// matmuls through a leading dimension), by slice node.
    pub views: HashMap<NodeId, SliceView>,
    /// The scattered node (a vertex function's new state), when a fused
    /// group of the per-task phase writes it and nothing else reads it: the
    /// engine then points its rows at the state buffer, so no copy
    /// scatters them.
    pub scatter_in_place: Option<NodeId>,
}

/// Phase indices of a vertex function's programs.
pub(crate) const EAGER: usize = 0;
pub(crate) const PER_TASK: usize = 1;
pub(crate) const LAZY: usize = 2;
/// Phase indices of the head's forward program.
pub(crate) const HEAD_ALL: usize = 0;
pub(crate) const HEAD_SCORES: usize = 1;

/// Everything compiled for one model.
pub(crate) struct Program {
    /// Per vertex function: `F` for training (keeping what `∂F` reads) and `∂F`.
    pub functions: Vec<(GraphProgram, GraphProgram)>,
    /// Per vertex function: `F` for evaluation and inference (keeping
    /// nothing for a backward pass, so more stays in registers).
    pub infer_functions: Vec<GraphProgram>,
    pub head_forward: GraphProgram,
    pub head_forward_infer: GraphProgram,
    pub head_backward: GraphProgram,
    /// Parameters whose gradient arrives only as rows (embedding tables).
    pub row_grad_params: BTreeSet<usize>,
    /// Node counts of every graph, to check that later calls pass the same model.
    pub fingerprint: Vec<usize>,
    /// Fused kernels compiled for the model (distinct sources).
    pub fused_kernels: usize,
    /// Fusion listing for reports.
    pub listing: String,
}

/// A phase planned but not yet bound to compiled kernels.
pub(crate) struct PlannedGraph {
    pub phases: Vec<fusion::FusionPlan>,
    pub materialized: Vec<bool>,
    pub views: HashMap<NodeId, SliceView>,
    scatter_in_place: Option<NodeId>,
    /// Values kept for another graph (the backward's reads).
    keep: BTreeSet<NodeId>,
}

impl PlannedGraph {
    /// Sets [`GraphProgram::scatter_in_place`] for vertex function `func`'s
    /// forward plan; such a node needs no buffer of its own.
    fn scatter_into_state(
        &mut self,
        func: &ramus_core::model::VertexFunction,
        keep: &BTreeSet<NodeId>,
    ) {
        self.scatter_in_place = scatter_in_place(func, &self.phases[PER_TASK], keep);
        if let Some(sc) = self.scatter_in_place {
            self.materialized[sc] = false;
        }
    }
}

/// The scattered node of `func` when the per-task phase `plan` writes it
/// from a fused group (as an output or an in-place concat) and no other
/// node, phase, backward graph (`keep`) or the head (through the pushed
/// node) reads it: see [`GraphProgram::scatter_in_place`].
fn scatter_in_place(
    func: &ramus_core::model::VertexFunction,
    plan: &fusion::FusionPlan,
    keep: &BTreeSet<NodeId>,
) -> Option<NodeId> {
    let sc = func.scatter?;
    let g = &func.forward;
    let written_by_group =
        plan.is_in_place_concat(sc) || plan.groups().any(|group| group.outputs.contains(&sc));
    let unread = g.nodes.iter().all(|n| !n.inputs.contains(&sc));
    (written_by_group && unread && !keep.contains(&sc) && func.push != Some(sc)).then_some(sc)
}

pub(crate) fn op_nodes(graph: &Graph, wanted: impl Fn(NodeId) -> bool) -> Vec<NodeId> {
    (0..graph.nodes.len())
        .filter(|&n| matches!(graph.nodes[n].kind, NodeKind::Op(_)) && wanted(n))
        .collect()
}

/// Nodes that `roots` depend on.
pub(crate) fn ancestors(g: &Graph, roots: &[NodeId]) -> Vec<bool> {
    let mut need = vec![false; g.nodes.len()];
    for &r in roots {
        need[r] = true;
    }
    for i in (0..g.nodes.len()).rev() {
        if need[i] {
            for &x in &g.nodes[i].inputs {
                need[x] = true;
            }
        }
    }
    need
}

pub(crate) fn plan_graph(
    graph: &Graph,
    phases: &[Vec<NodeId>],
    keep: &BTreeSet<NodeId>,
    kernels: &mut BTreeMap<String, String>,
) -> Result<PlannedGraph> {
    let mut materialized = vec![true; graph.nodes.len()];
    let mut views = HashMap::new();
    let mut plans = Vec::with_capacity(phases.len());
    for nodes in phases {
        let plan = fusion::fuse(graph, nodes, &|n| keep.contains(&n))?;
        for v in &plan.views {
            materialized[v.slice] = false;
            views.insert(v.slice, *v);
        }
        // read by fused groups straight from their operands
        for &n in &plan.inline_reads {
            materialized[n] = false;
        }
        for group in plan.groups() {
            let kernel = group.kernel(graph)?;
            kernels.entry(kernel.name).or_insert(kernel.source);
            for &n in &group.nodes {
                if !group.outputs.contains(&n) {
                    materialized[n] = false;
                }
            }
        }
        plans.push(plan);
    }
    Ok(PlannedGraph {
        phases: plans,
        materialized,
        views,
        scatter_in_place: None,
        keep: keep.clone(),
    })
}

/// The steps of a planned graph (no kernels yet): fusion plans in order,
/// a lone bias add after a product merged into a [`PlannedStep::GemmBias`].
fn lower(planned: PlannedGraph, graph: &Graph) -> GraphProgram {
    let mut phases = Vec::with_capacity(planned.phases.len());
    let users = graph.users();
    let is_output = graph.output_mask();
    for plan in planned.phases {
        let mut steps: Vec<ExecStep> = Vec::with_capacity(plan.steps.len());
        for step in plan.steps {
            if let Step::Fused(group) = &step {
                if let Some((at, matmul, bias)) =
                    bias_of_product(graph, group, &steps, &users, &is_output, &planned.keep)
                {
                    steps[at].step = PlannedStep::GemmBias {
                        matmul,
                        bias,
                        group: group.clone(),
                    };
                    continue;
                }
            }
            let step = match step {
                Step::Op(n) => PlannedStep::Op(n),
                Step::Fused(group) => PlannedStep::Fused(group),
            };
            steps.push(ExecStep { step, kernel: None });
        }
        phases.push(steps);
    }
    GraphProgram {
        phases,
        materialized: planned.materialized,
        views: planned.views,
        scatter_in_place: planned.scatter_in_place,
    }
}

/// Looks up the kernel of every fused step of `prog` in `module`.
fn attach_kernels(
    prog: &mut GraphProgram,
    graph: &Graph,
    module: Option<&crate::rtc::LoadedModule>,
) -> Result<()> {
    for step in prog.phases.iter_mut().flatten() {
        if let Some(group) = step.step.group() {
            let name = group.kernel(graph)?.name;
            let module = module.ok_or(CudaError::KernelNotFound { name: name.clone() })?;
            step.kernel = Some(module.function(&name)?.clone());
        }
    }
    Ok(())
}

/// If fused `group` is a lone `add(p, bias)` (a broadcast `bias`
/// parameter) of a product `p = matmul(A, Bᵀ)` with a static `B` that an
/// earlier step of `steps` computes and that nothing else reads (no other
/// user, not kept, not a graph output): that step's index, `p` and `bias`.
fn bias_of_product(
    graph: &Graph,
    group: &FusedGroup,
    steps: &[ExecStep],
    users: &[Vec<NodeId>],
    is_output: &[bool],
    keep: &BTreeSet<NodeId>,
) -> Option<(usize, NodeId, NodeId)> {
    let [add] = group.nodes[..] else { return None };
    let node = &graph.nodes[add];
    if !matches!(node.op(), Some(Op::Add(_)))
        || group.outputs != [add]
        || !group.concat_writes.is_empty()
    {
        return None;
    }
    let [i0, i1] = group.inputs[..] else {
        return None;
    };
    let (product, bias) = match (i0.kind, i1.kind) {
        (InputKind::PerElement, InputKind::Broadcast) => (i0.node, i1.node),
        (InputKind::Broadcast, InputKind::PerElement) => (i1.node, i0.node),
        _ => return None,
    };
    let Some(Op::MatMul(mm)) = graph.nodes[product].op() else {
        return None;
    };
    let weight = graph.nodes[product].inputs.get(1)?;
    let plain_weight = !graph.nodes[*weight].ty.is_rows();
    let only_reader = users[product] == [add] && !is_output[product] && !keep.contains(&product);
    if mm.trans_a || !mm.trans_b || !plain_weight || !only_reader {
        return None;
    }
    if !matches!(graph.nodes[bias].kind, NodeKind::Param(_)) {
        return None;
    }
    let at = steps
        .iter()
        .position(|s| matches!(s.step, PlannedStep::Op(n) if n == product))?;
    Some((at, product, bias))
}

impl Program {
    /// Plans every phase of `model` (fusion, views, steps) without a
    /// device: the program the engine runs, with no kernels attached, and
    /// the sources of its fused kernels by name.
    pub(crate) fn plan(model: &Model) -> Result<(Program, BTreeMap<String, String>)> {
        let mut kernels = BTreeMap::new();
        let mut functions = Vec::new();
        let mut infer_functions = Vec::new();
        let none = BTreeSet::new();
        for func in &model.functions {
            // forward values the backward graph reads must stay in memory
            let keep = fusion::forward_reads(&func.backward);
            let fp = &func.forward_plan;
            let phases = [fp.eager.clone(), fp.per_task.clone(), fp.lazy.clone()];
            let mut fwd = plan_graph(&func.forward, &phases, &keep, &mut kernels)?;
            fwd.scatter_into_state(func, &keep);
            let mut infer = plan_graph(&func.forward, &phases, &none, &mut kernels)?;
            infer.scatter_into_state(func, &none);
            infer_functions.push(lower(infer, &func.forward));
            let bp = &func.backward_plan;
            let bwd = plan_graph(
                &func.backward,
                &[bp.eager.clone(), bp.per_task.clone(), bp.lazy.clone()],
                &none,
                &mut kernels,
            )?;
            functions.push((lower(fwd, &func.forward), lower(bwd, &func.backward)));
        }
        let head = &model.head;
        let keep = fusion::forward_reads(&head.backward);
        let scores = ancestors(&head.forward, &head.logits.into_iter().collect::<Vec<_>>());
        let head_phases = [
            op_nodes(&head.forward, |_| true),
            op_nodes(&head.forward, |n| scores[n]),
        ];
        let head_fwd = plan_graph(&head.forward, &head_phases, &keep, &mut kernels)?;
        let head_fwd_infer = plan_graph(&head.forward, &head_phases, &none, &mut kernels)?;
        let head_bwd = plan_graph(
            &head.backward,
            &[op_nodes(&head.backward, |_| true)],
            &none,
            &mut kernels,
        )?;
        let program = Program {
            functions,
            infer_functions,
            head_forward_infer: lower(head_fwd_infer, &head.forward),
            head_forward: lower(head_fwd, &head.forward),
            head_backward: lower(head_bwd, &head.backward),
            row_grad_params: model.row_grad_params(),
            fingerprint: fingerprint(model),
            fused_kernels: kernels.len(),
            listing: fusion_listing(model)?,
        };
        Ok((program, kernels))
    }

    /// Plans, generates and compiles every kernel of `model`.
    pub fn build(model: &Model, cache: &KernelCache) -> Result<Program> {
        let (mut program, kernels) = Program::plan(model)?;
        let source: String = kernels.values().map(String::as_str).collect();
        let kernel_names: Vec<&str> = kernels.keys().map(String::as_str).collect();
        let module = if kernels.is_empty() {
            None
        } else {
            Some(cache.get_or_compile(&source, &kernel_names)?)
        };
        let module = module.as_deref();
        for (func, (fwd, bwd)) in model.functions.iter().zip(&mut program.functions) {
            attach_kernels(fwd, &func.forward, module)?;
            attach_kernels(bwd, &func.backward, module)?;
        }
        for (func, infer) in model.functions.iter().zip(&mut program.infer_functions) {
            attach_kernels(infer, &func.forward, module)?;
        }
        let head = &model.head;
        attach_kernels(&mut program.head_forward, &head.forward, module)?;
        attach_kernels(&mut program.head_forward_infer, &head.forward, module)?;
        attach_kernels(&mut program.head_backward, &head.backward, module)?;
        Ok(program)
    }
}

/// The training-time fusion plan of every phase of every vertex function
/// (forward and backward) and of the head, with op and launch counts: what
/// the CUDA engine runs per task (`ramus inspect --fusion`). Needs no device.
pub fn fusion_listing(model: &Model) -> Result<String> {
    let names = model.param_names();
    let mut listing = String::new();
    let mut section =
        |title: String, g: &Graph, nodes: &[NodeId], keep: &BTreeSet<NodeId>| -> Result<()> {
            let plan = fusion::fuse(g, nodes, &|n| keep.contains(&n))?;
            let _ = writeln!(listing, "== {title}: {}", plan.listing(g, &names));
            Ok(())
        };
    let none = BTreeSet::new();
    for func in &model.functions {
        let keep = fusion::forward_reads(&func.backward);
        for (what, g, plan, keep) in [
            ("F", &func.forward, &func.forward_plan, &keep),
            ("∂F", &func.backward, &func.backward_plan, &none),
        ] {
            for (phase, nodes) in [
                ("eager", &plan.eager),
                ("per-task", &plan.per_task),
                ("lazy", &plan.lazy),
            ] {
                section(format!("{what} `{}` {phase}", func.name), g, nodes, keep)?;
            }
        }
    }
    let head = &model.head;
    section(
        "head".into(),
        &head.forward,
        &op_nodes(&head.forward, |_| true),
        &fusion::forward_reads(&head.backward),
    )?;
    section(
        "head ∂".into(),
        &head.backward,
        &op_nodes(&head.backward, |_| true),
        &none,
    )?;
    Ok(listing)
}

/// Node counts of every graph of `model`.
pub(crate) fn fingerprint(model: &Model) -> Vec<usize> {
    let mut f: Vec<usize> = model
        .functions
        .iter()
        .flat_map(|func| [func.forward.nodes.len(), func.backward.nodes.len()])
        .collect();
    f.extend([
        model.head.forward.nodes.len(),
        model.head.backward.nodes.len(),
        model.params.len(),
    ]);
    f
}
