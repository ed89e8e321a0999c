//! Tests for the fusion and code generation passes: which ops fuse (LSTM
//! cell, cycles through non-elementwise ops, spaces, widths, broadcast
//! statics, sibling groups reading a common value), which values are
//! materialized, which slices are read in place (views), which concats are
//! written in place and which child sums and expansions are read inline
//! through the row topology, plan validity on real model phases and on
//! random DAGs (proptest), the CPU interpreter against op-by-op evaluation,
//! and the generated CUDA source compiled for the host with the system
//! C++/C compiler and run against op-by-op results.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::process::Command;

use common::{assert_close, eval, run_op, Env, Rng, Topo, Val};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, TestRunner};
use ramus_codegen::fused::{FusedKernel, FusedSource};
use ramus_core::fusion::{
    forward_reads, fuse, ConcatWrite, FusedGroup, FusedInput, FusionPlan, InputKind, SliceView,
    Step,
};
use ramus_core::model::{HeadRows, Init, ModelBuilder};
use ramus_core::ops::{MatMul, Op};
use ramus_core::{Graph, GraphBuilder, NodeId, NodeKind, OpRegistry, Role, Source, Space, Sym};
use ramus_core::{OpDef, ValueType};
use ramus_cpu::fused::eval_group;

const V: Space = Space::Vertex;
const E: Space = Space::Edge;

fn rows(space: Space, w: usize) -> ValueType {
    ValueType::rows(space, w)
}

/// Every op node of `g`, in order.
fn op_nodes(g: &Graph) -> Vec<NodeId> {
    (0..g.nodes.len())
        .filter(|&i| matches!(g.nodes[i].kind, NodeKind::Op(_)))
        .collect()
}

fn is_elementwise(g: &Graph, v: NodeId) -> bool {
    g.nodes[v]
        .op()
        .is_some_and(|op| op.elementwise_template().is_some())
}

fn no_keep(_: NodeId) -> bool {
    false
}

fn fuse_all(g: &Graph) -> FusionPlan {
    fuse(g, &op_nodes(g), &no_keep).unwrap_or_else(|e| panic!("fuse failed: {e}"))
}

fn groups(plan: &FusionPlan) -> Vec<&FusedGroup> {
    plan.groups().collect()
}

/// The group containing node `v`.
fn group_of(plan: &FusionPlan, v: NodeId) -> &FusedGroup {
    plan.groups()
        .find(|g| g.nodes.contains(&v))
        .unwrap_or_else(|| panic!("%{v} is in no fused group:\n{plan}"))
}

fn ids(s: &[Sym]) -> Vec<NodeId> {
    s.iter().map(|s| s.id()).collect()
}

// ======================================================================
// Plan checks and evaluation
// ======================================================================

fn op_at(g: &Graph, v: NodeId) -> Option<&Op> {
    g.nodes[v].op()
}

fn matmul_of(op: &Op) -> Option<&MatMul> {
    match op {
        Op::MatMul(mm) => Some(mm),
        _ => None,
    }
}

/// What a plan runs without a step of its own, from the rules alone.
struct NoStep {
    views: Vec<SliceView>,
    in_place_concats: Vec<NodeId>,
    inline_reads: Vec<NodeId>,
}

/// The views, in-place concats and inline reads `plan` must have, from the
/// rules alone.
fn expected_without_step(g: &Graph, nodes: &[NodeId], keep: &dyn Fn(NodeId) -> bool) -> NoStep {
    let users = g.users();
    let listed = |v: NodeId| nodes.contains(&v);
    let is_output = |m: NodeId| g.outputs.iter().any(|o| o.node == m || o.aux == Some(m));
    let fused = |v: NodeId| listed(v) && is_elementwise(g, v);
    let mut views = Vec::new();
    let mut concats = Vec::new();
    for &v in nodes {
        if let Some(Op::Slice(sl)) = op_at(g, v) {
            let src = g.nodes[v].inputs[0];
            let ok = !keep(v)
                && !is_output(v)
                && users[v].iter().all(|&u| {
                    listed(u)
                        && (fused(u)
                            || matches!(op_at(g, u), Some(Op::SumChildren(_)))
                            || op_at(g, u).and_then(matmul_of).is_some_and(|mm| {
                                let ins = &g.nodes[u].inputs;
                                if mm.trans_a {
                                    true
                                } else {
                                    ins[0] == v && ins[1] != v
                                }
                            }))
                });
            if ok {
                views.push(SliceView {
                    slice: v,
                    source: src,
                    offset: sl.start,
                    stride: g.nodes[src].ty.width(),
                    len: sl.len,
                });
            }
        } else if matches!(op_at(g, v), Some(Op::Concat(_)))
            && g.nodes[v].inputs.iter().all(|&x| fused(x))
        {
            concats.push(v);
        }
    }
    // a child sum (expansion) whose every reader is a fused op on vertex
    // (edge) rows of its width, of an edge-row (vertex-row) value that is not
    // a viewed slice
    let mut inline_reads = Vec::new();
    for &v in nodes {
        let readers = if matches!(op_at(g, v), Some(Op::SumChildren(_))) {
            V
        } else if matches!(op_at(g, v), Some(Op::ExpandChildren(_))) {
            E
        } else {
            continue;
        };
        let w = g.nodes[v].ty.width();
        let src = g.nodes[v].inputs[0];
        let ok = !keep(v)
            && !is_output(v)
            && !views.iter().any(|s| s.slice == src)
            && !users[v].is_empty()
            && users[v]
                .iter()
                .all(|&u| fused(u) && g.nodes[u].ty.space == readers && g.nodes[u].ty.width() == w);
        if ok {
            inline_reads.push(v);
        }
    }
    NoStep {
        views,
        in_place_concats: concats,
        inline_reads,
    }
}

/// The kind of input an inline read `x` is for its readers.
fn inline_kind(g: &Graph, x: NodeId) -> InputKind {
    let source = g.nodes[x].inputs[0];
    if matches!(op_at(g, x), Some(Op::SumChildren(_))) {
        InputKind::ChildSum { source }
    } else {
        InputKind::ParentRow { source }
    }
}

/// Checks `plan` for `nodes` independently of the pass: every listed op in
/// exactly one step or as a view / in-place concat / inline read (exactly
/// those the rules allow), dependencies respected (through views and inline
/// reads to their source, through in-place concats to every writer), groups
/// well formed (members elementwise, one space and width, inputs, outputs
/// and concat writes exactly as specified), and neither an unfused fusable
/// edge nor two groups reading a common value could have been fused without
/// closing a cycle among the steps.
fn check_plan(g: &Graph, nodes: &[NodeId], keep: &dyn Fn(NodeId) -> bool, plan: &FusionPlan) {
    let n = g.nodes.len();
    let listed: Vec<bool> = (0..n).map(|i| nodes.contains(&i)).collect();
    let want = expected_without_step(g, nodes, keep);
    assert_eq!(plan.views, want.views, "views:\n{plan}");
    assert_eq!(
        plan.in_place_concats, want.in_place_concats,
        "in-place concats:\n{plan}"
    );
    assert_eq!(
        plan.inline_reads, want.inline_reads,
        "inline reads:\n{plan}"
    );
    let ops = plan
        .steps
        .iter()
        .filter(|s| matches!(s, Step::Op(_)))
        .count();
    let members: usize = plan.groups().map(|grp| grp.nodes.len()).sum();
    assert_eq!(
        plan.op_count(),
        ops + members + plan.views.len() + plan.in_place_concats.len() + plan.inline_reads.len()
    );
    assert_eq!(plan.op_count(), nodes.len());
    assert_eq!(plan.kernel_launches(), plan.steps.len());
    let is_view = |v: NodeId| plan.views.iter().find(|w| w.slice == v);
    let in_place = |v: NodeId| plan.in_place_concats.contains(&v);
    let inline = |v: NodeId| plan.is_inline_read(v);
    let mut step_of: Vec<Option<usize>> = vec![None; n];
    for (s, step) in plan.steps.iter().enumerate() {
        let members: Vec<NodeId> = match step {
            Step::Op(v) => {
                assert!(!is_elementwise(g, *v), "elementwise %{v} left unfused");
                assert!(
                    is_view(*v).is_none() && !in_place(*v) && !inline(*v),
                    "%{v} has a step"
                );
                vec![*v]
            }
            Step::Fused(grp) => grp.nodes.clone(),
        };
        for v in members {
            assert!(listed[v], "step {s} holds unlisted %{v}");
            assert!(step_of[v].is_none(), "%{v} in two steps");
            step_of[v] = Some(s);
        }
    }
    // the steps a reader of `x` must come after (strictly, unless `x` is
    // computed by the reader's own step)
    fn deps(
        g: &Graph,
        plan: &FusionPlan,
        step_of: &[Option<usize>],
        x: NodeId,
        out: &mut Vec<(usize, bool)>,
    ) {
        if let Some(v) = plan.view(x) {
            deps(g, plan, step_of, v.source, out);
            out.iter_mut().for_each(|d| d.1 = true);
        } else if plan.is_inline_read(x) {
            deps(g, plan, step_of, g.nodes[x].inputs[0], out);
            out.iter_mut().for_each(|d| d.1 = true);
        } else if plan.is_in_place_concat(x) {
            for &i in &g.nodes[x].inputs {
                if let Some(s) = step_of[i] {
                    out.push((s, true));
                }
            }
        } else if let Some(s) = step_of[x] {
            out.push((s, false));
        }
    }
    for &v in nodes {
        if is_view(v).is_some() || in_place(v) || inline(v) {
            continue;
        }
        let Some(sv) = step_of[v] else {
            panic!("%{v} is in no step:\n{plan}")
        };
        for &x in &g.nodes[v].inputs {
            let mut d = Vec::new();
            deps(g, plan, &step_of, x, &mut d);
            for (sx, strict) in d {
                assert!(
                    sx < sv || (sx == sv && !strict),
                    "%{v} (step {sv}) reads %{x}, which needs step {sx}:\n{plan}"
                );
            }
            if is_view(x).is_some() {
                let ok = matches!(&plan.steps[sv], Step::Fused(_))
                    || matches!(op_at(g, v), Some(Op::MatMul(_)))
                    || matches!(op_at(g, v), Some(Op::SumChildren(_)));
                assert!(ok, "%{v} reads view %{x} but cannot:\n{plan}");
            }
            if inline(x) {
                assert!(
                    matches!(&plan.steps[sv], Step::Fused(_)),
                    "%{v} reads inline read %{x} but is no fused group member:\n{plan}"
                );
            }
        }
    }
    let users = g.users();
    let is_output = |m: NodeId| g.outputs.iter().any(|o| o.node == m || o.aux == Some(m));
    for grp in plan.groups() {
        let pos = |v: NodeId| nodes.iter().position(|&x| x == v);
        assert!(
            grp.nodes.windows(2).all(|w| pos(w[0]) < pos(w[1])),
            "members out of order"
        );
        let member = |x: NodeId| grp.nodes.contains(&x);
        let mut want_inputs: Vec<FusedInput> = Vec::new();
        for &m in &grp.nodes {
            let ty = &g.nodes[m].ty;
            assert!(is_elementwise(g, m), "%{m} is not elementwise");
            assert_eq!(
                (ty.space, ty.width()),
                (grp.space, grp.width),
                "%{m} in a group of another space or width"
            );
            for &x in &g.nodes[m].inputs {
                if !member(x) && !want_inputs.iter().any(|i| i.node == x) {
                    let kind = if let Some(v) = is_view(x) {
                        InputKind::Window {
                            source: v.source,
                            offset: v.offset,
                            stride: v.stride,
                        }
                    } else if inline(x) {
                        inline_kind(g, x)
                    } else if grp.space != Space::Static && g.nodes[x].ty.space == Space::Static {
                        InputKind::Broadcast
                    } else {
                        InputKind::PerElement
                    };
                    want_inputs.push(FusedInput { node: x, kind });
                }
            }
        }
        assert_eq!(grp.inputs, want_inputs, "inputs of {grp:?}");
        let want_outputs: Vec<NodeId> = grp
            .nodes
            .iter()
            .copied()
            .filter(|&m| {
                is_output(m)
                    || keep(m)
                    || users[m].is_empty()
                    || users[m].iter().any(|&u| !member(u) && !in_place(u))
            })
            .collect();
        assert_eq!(grp.outputs, want_outputs, "outputs of {grp:?}");
        let mut want_writes = Vec::new();
        for &m in &grp.nodes {
            let mut cs: Vec<NodeId> = users[m].iter().copied().filter(|&u| in_place(u)).collect();
            cs.dedup();
            for c in cs {
                let mut offset = 0;
                for &x in &g.nodes[c].inputs {
                    if x == m {
                        want_writes.push(ConcatWrite {
                            member: m,
                            concat: c,
                            offset,
                            stride: g.nodes[c].ty.width(),
                        });
                    }
                    offset += g.nodes[x].ty.width();
                }
            }
        }
        assert_eq!(grp.concat_writes, want_writes, "concat writes of {grp:?}");
    }
    // every input of an in-place concat is written by exactly one group
    for &c in &plan.in_place_concats {
        let mut offset = 0;
        for &x in &g.nodes[c].inputs {
            let writers = plan
                .groups()
                .filter(|grp| {
                    grp.concat_writes
                        .iter()
                        .any(|w| w.member == x && w.concat == c && w.offset == offset)
                })
                .count();
            assert_eq!(writers, 1, "%{x} into %{c} at {offset}:\n{plan}");
            offset += g.nodes[x].ty.width();
        }
    }
    // maximality: merging the two groups of any unfused fusable edge closes
    // a cycle (views and in-place concats still separate their neighbours)
    let unit = |v: NodeId| step_of[v].unwrap_or(n + v);
    for &v in nodes {
        for &x in &g.nodes[v].inputs {
            let fusable = listed[x]
                && is_elementwise(g, x)
                && is_elementwise(g, v)
                && g.nodes[x].ty.space == g.nodes[v].ty.space
                && g.nodes[x].ty.width() == g.nodes[v].ty.width();
            if fusable && unit(x) != unit(v) {
                let (a, b) = (unit(x), unit(v));
                let merged = |s: usize| if s == b { a } else { s };
                assert!(
                    steps_have_cycle(g, nodes, &|u| merged(unit(u))),
                    "%{x} -> %{v} could have been fused:\n{plan}"
                );
            }
        }
    }
    // ... and merging two groups of one space and width that read a
    // common value does too
    let reads: Vec<BTreeSet<NodeId>> = plan
        .steps
        .iter()
        .map(|s| match s {
            Step::Fused(grp) => grp
                .nodes
                .iter()
                .flat_map(|&m| g.nodes[m].inputs.iter().copied())
                .collect(),
            Step::Op(_) => BTreeSet::new(),
        })
        .collect();
    for (a, sa) in plan.steps.iter().enumerate() {
        for (b, sb) in plan.steps.iter().enumerate().skip(a + 1) {
            let (Step::Fused(ga), Step::Fused(gb)) = (sa, sb) else {
                continue;
            };
            if (ga.space, ga.width) != (gb.space, gb.width) {
                continue;
            }
            if let Some(x) = reads[a].intersection(&reads[b]).next() {
                let merged = |s: usize| if s == b { a } else { s };
                assert!(
                    steps_have_cycle(g, nodes, &|u| merged(unit(u))),
                    "steps {a} and {b} both read %{x} and could have been fused:\n{plan}"
                );
            }
        }
    }
}

/// True if the graph of steps (`unit_of` maps a listed node to its step)
/// has a cycle.
fn steps_have_cycle(g: &Graph, nodes: &[NodeId], unit_of: &dyn Fn(NodeId) -> usize) -> bool {
    let units: BTreeSet<usize> = nodes.iter().map(|&v| unit_of(v)).collect();
    let mut edges: BTreeSet<(usize, usize)> = BTreeSet::new();
    for &v in nodes {
        for &x in &g.nodes[v].inputs {
            if nodes.contains(&x) && unit_of(x) != unit_of(v) {
                edges.insert((unit_of(x), unit_of(v)));
            }
        }
    }
    let mut indeg: HashMap<usize, usize> = units.iter().map(|&u| (u, 0)).collect();
    for &(_, b) in &edges {
        *indeg.entry(b).or_default() += 1;
    }
    let mut ready: Vec<usize> = units.iter().copied().filter(|u| indeg[u] == 0).collect();
    let mut done = 0;
    while let Some(u) = ready.pop() {
        done += 1;
        for &(a, b) in &edges {
            if a == u {
                let d = indeg.entry(b).or_default();
                *d -= 1;
                if *d == 0 {
                    ready.push(b);
                }
            }
        }
    }
    done != units.len()
}

/// Columns `offset..offset + len` of each of `rows` rows of `stride`.
fn window(src: &[f64], rows: usize, stride: usize, offset: usize, len: usize) -> Vec<f64> {
    (0..rows)
        .flat_map(|r| {
            src[r * stride + offset..r * stride + offset + len]
                .iter()
                .copied()
        })
        .collect()
}

/// The CSR edge offsets of `topo`'s vertex rows (`vertex_rows + 1`
/// entries): vertex `r`'s child edges are `offsets[r]..offsets[r + 1]`.
fn edge_offsets(topo: &Topo) -> Vec<u32> {
    assert!(
        topo.edge_parent.windows(2).all(|w| w[0] <= w[1]),
        "test bug: edges not grouped by parent"
    );
    (0..=topo.vertex_rows)
        .map(|r| topo.edge_parent.partition_point(|&p| (p as usize) < r) as u32)
        .collect()
}

/// The index array a fused kernel takes for a CSR input of `kind`, relative
/// to the launched rows: CSR edge offsets for a child sum, each edge's
/// parent for a parent row.
fn csr_rows(topo: &Topo, kind: InputKind) -> Vec<u32> {
    match kind {
        InputKind::ChildSum { .. } => edge_offsets(topo),
        InputKind::ParentRow { .. } => topo.edge_parent.clone(),
        _ => panic!("test bug: {kind:?} is no CSR input"),
    }
}

/// Evaluates `g` op by op (the reference). A backward graph's reads of the
/// forward graph and of output gradients come from `env.inputs`
/// (`Source::Forward(m)`, `Source::OutputGrad(i)`) like any other input.
fn reference(g: &Graph, env: &Env) -> Vec<Val> {
    let mut fwd: Vec<Val> = Vec::new();
    let mut out_grads = HashMap::new();
    for (s, v) in &env.inputs {
        match *s {
            Source::Forward(m) => {
                if fwd.len() <= m {
                    fwd.resize(m + 1, Val::F(vec![]));
                }
                fwd[m] = v.clone();
            }
            Source::OutputGrad(i) => {
                out_grads.insert(i, v.f().to_vec());
            }
            _ => {}
        }
    }
    let fwd = (!fwd.is_empty()).then_some(fwd.as_slice());
    eval(g, env, fwd, &out_grads).unwrap_or_else(|e| panic!("reference: {e}"))
}

/// Runs `plans` in order (ops through their kernels, fused groups through
/// `eval_group`), starting from `env`'s inputs and parameters, the way an
/// engine does: a view has no value of its own (groups get its source, a
/// matmul its window), an inline read neither (groups get its operand and
/// the topology), and an in-place concat's buffer (NaN at first) is filled
/// by the groups writing into it. Returns every value the plans
/// materialized; reading a value no step materialized fails.
fn run_plans(g: &Graph, env: &Env, plans: &[&FusionPlan]) -> Result<Vec<Option<Vec<f64>>>, String> {
    let topo = &env.topo;
    let mut vals: Vec<Option<Vec<f64>>> = vec![None; g.nodes.len()];
    let mut index_vals: HashMap<NodeId, Val> = HashMap::new();
    for (i, node) in g.nodes.iter().enumerate() {
        match node.kind {
            NodeKind::Input(s) => match env.inputs.get(&s) {
                Some(Val::F(v)) => vals[i] = Some(v.clone()),
                Some(v) => {
                    index_vals.insert(i, v.clone());
                }
                None => {}
            },
            NodeKind::Param(p) => vals[i] = env.params.get(p).cloned(),
            NodeKind::Op(_) => {}
        }
    }
    let get = |vals: &[Option<Vec<f64>>], x: NodeId, reader: &str| -> Result<Val, String> {
        if let Some(v) = index_vals.get(&x) {
            return Ok(v.clone());
        }
        vals[x]
            .clone()
            .map(Val::F)
            .ok_or_else(|| format!("%{x} was not materialized before {reader} read it"))
    };
    for plan in plans {
        for &c in &plan.in_place_concats {
            vals[c] = Some(vec![f64::NAN; topo.len(&g.nodes[c].ty)]);
        }
        for step in &plan.steps {
            match step {
                Step::Op(v) => {
                    let node = &g.nodes[*v];
                    let op = node.op().ok_or("op step on a non-op node")?;
                    let args = node
                        .inputs
                        .iter()
                        .map(|&x| {
                            let val = match plan.view(x) {
                                Some(w) => {
                                    let src = get(&vals, w.source, &format!("%{v}"))?;
                                    let rows = topo.rows(g.nodes[x].ty.space);
                                    Val::F(window(src.f(), rows, w.stride, w.offset, w.len))
                                }
                                None => get(&vals, x, &format!("%{v}"))?,
                            };
                            Ok((g.nodes[x].ty.clone(), val))
                        })
                        .collect::<Result<Vec<_>, String>>()?;
                    let (_, out) = run_op(op, &args, topo)?;
                    vals[*v] = Some(out);
                }
                Step::Fused(grp) => {
                    let ins = grp
                        .inputs
                        .iter()
                        .map(|i| get(&vals, i.buffer(), "a fused group").map(|v| v.f().to_vec()))
                        .collect::<Result<Vec<_>, String>>()?;
                    let ins: Vec<&[f64]> = ins.iter().map(|v| v.as_slice()).collect();
                    let csr: Vec<Vec<u32>> = grp
                        .inputs
                        .iter()
                        .filter(|i| i.kind.is_csr())
                        .map(|i| csr_rows(topo, i.kind))
                        .collect();
                    let csr: Vec<&[u32]> = csr.iter().map(|v| v.as_slice()).collect();
                    let r = topo.rows(grp.space);
                    let mut outs = vec![vec![f64::NAN; r * grp.width]; grp.outputs.len()];
                    let targets = grp.concat_targets();
                    let mut cats = targets
                        .iter()
                        .map(|&c| vals[c].take().ok_or(format!("%{c} has no buffer")))
                        .collect::<Result<Vec<_>, String>>()?;
                    {
                        let mut refs: Vec<&mut [f64]> =
                            outs.iter_mut().map(|o| o.as_mut_slice()).collect();
                        let mut cat_refs: Vec<&mut [f64]> =
                            cats.iter_mut().map(|o| o.as_mut_slice()).collect();
                        eval_group(grp, g, &ins, &csr, r, &mut refs, &mut cat_refs)
                            .map_err(|e| e.to_string())?;
                    }
                    for (&c, buf) in targets.iter().zip(cats) {
                        vals[c] = Some(buf);
                    }
                    for (&o, v) in grp.outputs.iter().zip(outs) {
                        vals[o] = Some(v);
                    }
                }
            }
        }
    }
    Ok(vals)
}

/// Evaluates `g` op by op (the reference) and through `plans`; every value
/// the plans materialized, every graph output and every kept value must
/// agree (same kernels in f64, so up to rounding of identical operations).
fn check_plans_match_reference(
    g: &Graph,
    env: &Env,
    plans: &[&FusionPlan],
    keep: &dyn Fn(NodeId) -> bool,
) {
    let want = reference(g, env);
    let got = run_plans(g, env, plans).unwrap_or_else(|e| panic!("plan evaluation: {e}"));
    for (i, v) in got.iter().enumerate() {
        if let Some(v) = v {
            assert_close(v, want[i].f(), 1e-12, &format!("%{i}"));
        }
    }
    for o in &g.outputs {
        assert!(got[o.node].is_some(), "graph output %{} lost", o.node);
    }
    for (i, (node, v)) in g.nodes.iter().zip(&got).enumerate() {
        if keep(i) && matches!(node.kind, NodeKind::Op(_)) {
            assert!(v.is_some(), "kept %{i} lost");
        }
    }
}

// ======================================================================
// Host compilation of generated kernels
// ======================================================================

/// One launch of a generated kernel on the host.
struct HostCall {
    kernel: String,
    /// Input buffers (a window input's source buffer), in input order.
    inputs: Vec<Vec<f32>>,
    outputs: usize,
    /// Element count of each distinct concat buffer (pre-filled with
    /// [`SENTINEL`], so columns a kernel must not touch can be checked).
    concats: Vec<usize>,
    /// The concat buffer each concat write's pointer names.
    cat_args: Vec<usize>,
    /// The index array of each CSR input (absolute: `bases` added), in
    /// input order.
    rows: Vec<Vec<u32>>,
    n: usize,
    width: usize,
    /// The `unsigned int` arguments after `width`: window strides and
    /// offsets, then concat strides and offsets.
    tail: Vec<usize>,
    /// The base of each CSR input's indices (the last arguments).
    bases: Vec<usize>,
}

/// What concat buffers hold before a host kernel writes its columns.
const SENTINEL: f32 = -4096.0;

/// The system C++ compiler (or a C compiler, given the source without its
/// `extern "C"`), if there is one.
fn host_compiler() -> Option<(&'static str, bool)> {
    [("c++", true), ("g++", true), ("cc", false), ("gcc", false)]
        .into_iter()
        .find(|(cc, _)| {
            Command::new(cc)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
}

fn c_float(x: f32) -> String {
    format!("{x:e}f")
}

/// Compiles `kernels` as host code (one thread, one block: the grid-stride
/// loop covers everything) with a driver making `calls`, runs it, and
/// returns each call's outputs followed by its concat buffers; `None` (with
/// a notice) without a compiler.
fn run_on_host(
    tag: &str,
    kernels: &[FusedKernel],
    calls: &[HostCall],
) -> Option<Vec<Vec<Vec<f64>>>> {
    let Some((cc, cplusplus)) = host_compiler() else {
        // written to stderr directly: the test harness does not capture it, so CI logs show the skip
        let _ = std::io::Write::write_fmt(
            &mut std::io::stderr(),
            format_args!(
                "skipping: no C/C++ compiler found for the host run of generated kernels\n"
            ),
        );
        return None;
    };
    let mut src = String::from(
        "#include <math.h>\n#include <stdio.h>\n#define __global__\n\
         struct HostDim { unsigned int x; };\n\
         static const struct HostDim blockIdx = {0}, threadIdx = {0}, blockDim = {1}, gridDim = {1};\n\n",
    );
    let mut seen = BTreeSet::new();
    for k in kernels {
        if seen.insert(k.name.clone()) {
            let s = if cplusplus {
                k.source.clone()
            } else {
                k.source.replace("extern \"C\" ", "")
            };
            src += &s;
            src += "\n";
        }
    }
    for (c, call) in calls.iter().enumerate() {
        for (k, data) in call.inputs.iter().enumerate() {
            let mut vals: Vec<String> = data.iter().map(|&x| c_float(x)).collect();
            if vals.is_empty() {
                // a child sum over no edges at all: never read, but C wants an element
                vals.push(c_float(0.0));
            }
            src += &format!(
                "static const float c{c}_in{k}[] = {{{}}};\n",
                vals.join(", ")
            );
        }
        for (k, rows) in call.rows.iter().enumerate() {
            let vals: Vec<String> = rows.iter().map(|x| format!("{x}u")).collect();
            src += &format!(
                "static const unsigned int c{c}_rows{k}[] = {{{}}};\n",
                vals.join(", ")
            );
        }
        for k in 0..call.outputs {
            src += &format!("static float c{c}_out{k}[{}];\n", call.n);
        }
        for (k, len) in call.concats.iter().enumerate() {
            src += &format!("static float c{c}_cat{k}[{len}];\n");
        }
    }
    src += "\nint main(void) {\n";
    let print = |name: String, len: usize| {
        format!(
            "    for (unsigned long i = 0; i < {len}ul; ++i) printf(\"%.9e \", (double){name}[i]);\n    printf(\"\\n\");\n"
        )
    };
    for (c, call) in calls.iter().enumerate() {
        for (k, len) in call.concats.iter().enumerate() {
            src += &format!(
                "    for (unsigned long i = 0; i < {len}ul; ++i) c{c}_cat{k}[i] = {};\n",
                c_float(SENTINEL)
            );
        }
        let mut args: Vec<String> = (0..call.inputs.len())
            .map(|k| format!("c{c}_in{k}"))
            .collect();
        args.extend((0..call.outputs).map(|k| format!("c{c}_out{k}")));
        args.extend(call.cat_args.iter().map(|k| format!("c{c}_cat{k}")));
        args.extend((0..call.rows.len()).map(|k| format!("c{c}_rows{k}")));
        args.push(format!("{}ull", call.n));
        args.push(format!("{}u", call.width));
        args.extend(call.tail.iter().map(|t| format!("{t}u")));
        args.extend(call.bases.iter().map(|b| format!("{b}u")));
        src += &format!("    {}({});\n", call.kernel, args.join(", "));
        for k in 0..call.outputs {
            src += &print(format!("c{c}_out{k}"), call.n);
        }
        for (k, &len) in call.concats.iter().enumerate() {
            src += &print(format!("c{c}_cat{k}"), len);
        }
    }
    src += "    return 0;\n}\n";

    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("fusion-host-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let (file, exe) = (dir.join("kernels.c"), dir.join("kernels"));
    std::fs::write(&file, &src).expect("write source");
    let lang = if cplusplus { "c++" } else { "c" };
    let out = Command::new(cc)
        .args([
            "-x",
            lang,
            "-O1",
            "-ffp-contract=off",
            "-Wall",
            "-Werror",
            "-o",
        ])
        .arg(&exe)
        .arg(&file)
        .arg("-lm")
        .output()
        .expect("run the compiler");
    assert!(
        out.status.success(),
        "{cc} rejected the generated code:\n{}\n--- source ---\n{src}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = Command::new(&exe).output().expect("run the host program");
    assert!(run.status.success(), "host program failed");
    let text = String::from_utf8_lossy(&run.stdout).to_string();
    let mut lines = text.lines();
    let mut results = Vec::new();
    for call in calls {
        let mut outs = Vec::new();
        let lens = std::iter::repeat_n(call.n, call.outputs).chain(call.concats.iter().copied());
        for len in lens {
            let line = lines.next().expect("an output line per output");
            let v: Vec<f64> = line
                .split_whitespace()
                .map(|t| t.parse().expect("a printed float"))
                .collect();
            assert_eq!(v.len(), len);
            outs.push(v);
        }
        results.push(outs);
    }
    let _ = std::fs::remove_dir_all(&dir);
    Some(results)
}

/// Rounds every float input and parameter of `env` to f32 (so the f64
/// reference and the f32 host kernels start from the same numbers).
fn round_to_f32(env: &mut Env) {
    let r = |v: &mut Vec<f64>| v.iter_mut().for_each(|x| *x = *x as f32 as f64);
    env.params.iter_mut().for_each(r);
    for v in env.inputs.values_mut() {
        if let Val::F(v) = v {
            r(v);
        }
    }
}

/// Runs every fused group of `plans` as generated code on the host, fed
/// with the op-by-op reference values of its inputs (a window or inline
/// input: its source's; the index arrays of inline inputs absolute, offset
/// by a different non-zero base each), and compares its outputs and the
/// columns it writes into concat buffers with the reference within 1e-5
/// relative; the other columns of those buffers must be untouched. Returns
/// the number of kernels checked (0 without a compiler).
fn check_codegen_on_host(tag: &str, cases: &[(&Graph, &Env, Vec<&FusionPlan>)]) -> usize {
    let mut kernels = Vec::new();
    let mut calls = Vec::new();
    let mut expect = Vec::new();
    let references: Vec<Vec<Val>> = cases.iter().map(|(g, env, _)| reference(g, env)).collect();
    for (case, ((g, env, plans), want)) in cases.iter().zip(&references).enumerate() {
        for grp in plans.iter().flat_map(|p| p.groups()) {
            let rows = env.topo.rows(grp.space);
            if rows == 0 {
                continue;
            }
            let k = grp.kernel(g).unwrap_or_else(|e| panic!("codegen: {e}"));
            let targets = grp.concat_targets();
            let mut tail = Vec::new();
            let (mut csr, mut bases) = (Vec::new(), Vec::new());
            let inputs = grp
                .inputs
                .iter()
                .map(|i| {
                    if let InputKind::Window { offset, stride, .. } = i.kind {
                        tail.extend([stride, offset]);
                    }
                    if i.kind.is_csr() {
                        // as if the launch covered rows of a larger batch
                        let base = 1000 + 37 * calls.len() + 5 * bases.len();
                        let rows = csr_rows(&env.topo, i.kind);
                        csr.push(rows.iter().map(|&r| r + base as u32).collect());
                        bases.push(base);
                    }
                    want[i.buffer()].f().iter().map(|&x| x as f32).collect()
                })
                .collect();
            let mut cat_args = Vec::new();
            for w in &grp.concat_writes {
                tail.extend([w.stride, w.offset]);
                cat_args.push(targets.iter().position(|&c| c == w.concat).unwrap_or(0));
            }
            calls.push(HostCall {
                kernel: k.name.clone(),
                inputs,
                outputs: grp.outputs.len(),
                concats: targets
                    .iter()
                    .map(|&c| env.topo.len(&g.nodes[c].ty))
                    .collect(),
                cat_args,
                rows: csr,
                n: rows * grp.width,
                width: grp.width,
                tail,
                bases,
            });
            kernels.push(k);
            expect.push((case, grp, rows));
        }
    }
    let Some(results) = run_on_host(tag, &kernels, &calls) else {
        return 0;
    };
    for ((case, grp, rows), got) in expect.iter().zip(results) {
        let want = &references[*case];
        let (outs, cats) = got.split_at(grp.outputs.len());
        for (o, got) in grp.outputs.iter().zip(outs) {
            assert_close(
                got,
                want[*o].f(),
                1e-5,
                &format!("case {case}: generated kernel output %{o} of {grp:?}"),
            );
        }
        for (&c, got) in grp.concat_targets().iter().zip(cats) {
            let stride = cases[*case].0.nodes[c].ty.width();
            let mut written = vec![false; stride];
            for w in grp.concat_writes.iter().filter(|w| w.concat == c) {
                let have = window(got, *rows, stride, w.offset, grp.width);
                let need = window(want[c].f(), *rows, stride, w.offset, grp.width);
                assert_close(
                    &have,
                    &need,
                    1e-5,
                    &format!("case {case}: %{} written into %{c} by {grp:?}", w.member),
                );
                written[w.offset..w.offset + grp.width]
                    .iter_mut()
                    .for_each(|x| *x = true);
            }
            for (i, &x) in got.iter().enumerate() {
                if !written[i % stride] {
                    assert_eq!(
                        x,
                        f64::from(SENTINEL),
                        "case {case}: element {i} of %{c} overwritten by {grp:?}"
                    );
                }
            }
        }
    }
    calls.len()
}

// ======================================================================
// The LSTM cell
// ======================================================================

/// Nodes of the LSTM cell built by [`lstm_cell`].
struct Lstm {
    x: Sym,
    hc: Sym,
    b: Sym,
    h_prev: Sym,
    c_prev: Sym,
    mm_x: Sym,
    mm_h: Sym,
    z_bias: Sym,
    z: Sym,
    gates: Vec<Sym>,
    c: Sym,
    h: Sym,
    state: Sym,
}

/// `z = Wx x + b + Wh h_prev`, `i, f, o = σ(..)`, `u = tanh(..)`,
/// `c = f c_prev + i u`, `h = o tanh(c)`; scatters `[h; c]`, pushes `h`.
fn lstm_cell(d: usize, hd: usize) -> (Graph, Vec<Vec<usize>>, Lstm) {
    let shapes = vec![vec![4 * hd, d], vec![4 * hd, hd], vec![4 * hd]];
    let mut b = GraphBuilder::new("lstm", &shapes);
    let x = b.input(Source::Pull, rows(V, d));
    let hc = b.input(Source::Gather(0), rows(V, 2 * hd));
    let h_prev = b.slice(hc, 0, hd);
    let c_prev = b.slice(hc, hd, hd);
    let (wx, wh, bias) = (b.param(0), b.param(1), b.param(2));
    let mm_x = b.matmul(x, wx, false, true);
    let z_bias = b.add(mm_x, bias);
    let mm_h = b.matmul(h_prev, wh, false, true);
    let z = b.add(z_bias, mm_h);
    let gates = b.split(z, 4);
    let i = b.sigmoid(gates[0]);
    let f = b.sigmoid(gates[1]);
    let o = b.sigmoid(gates[2]);
    let u = b.tanh(gates[3]);
    let fc = b.mul(f, c_prev);
    let iu = b.mul(i, u);
    let c = b.add(fc, iu);
    let tc = b.tanh(c);
    let h = b.mul(o, tc);
    let state = b.concat(&[h, c]);
    b.output(Role::Scatter, state, None);
    b.output(Role::Push, h, None);
    let g = b.finish().unwrap_or_else(|e| panic!("{e}"));
    (
        g,
        shapes,
        Lstm {
            x,
            hc,
            b: bias,
            h_prev,
            c_prev,
            mm_x,
            mm_h,
            z_bias,
            z,
            gates,
            c,
            h,
            state,
        },
    )
}

fn lstm_env(g: &Graph, shapes: &[Vec<usize>], vertices: usize, seed: u64) -> Env {
    let mut rng = Rng::new(seed);
    let mut env = Env {
        topo: Topo::vertices(vertices),
        inputs: HashMap::new(),
        params: shapes
            .iter()
            .map(|s| rng.vec(s.iter().product(), -0.5, 0.5))
            .collect(),
    };
    for node in &g.nodes {
        if let NodeKind::Input(s) = node.kind {
            let n = env.topo.len(&node.ty);
            env.inputs.insert(s, Val::F(rng.vec(n, -1.0, 1.0)));
        }
    }
    round_to_f32(&mut env);
    env
}

#[test]
fn lstm_cell_fuses_into_two_groups_reading_slices_in_place_and_writing_the_state() {
    let (g, shapes, l) = lstm_cell(5, 3);
    let nodes = op_nodes(&g);
    let plan = fuse_all(&g);
    check_plan(&g, &nodes, &no_keep, &plan);
    let gs = groups(&plan);
    assert_eq!(gs.len(), 2, "{plan}");
    assert_eq!(plan.op_count(), nodes.len());
    // matmul, matmul, [z], [cell]: the six slices are views, the concat is
    // written by the cell (was 11 launches with slice and concat kernels)
    assert_eq!(plan.kernel_launches(), 4, "{plan}");
    let hc = l.hc.id();
    let z = l.z.id();
    let view = |s: Sym, source: NodeId, offset: usize, stride: usize| SliceView {
        slice: s.id(),
        source,
        offset,
        stride,
        len: 3,
    };
    let mut want_views = vec![view(l.h_prev, hc, 0, 6), view(l.c_prev, hc, 3, 6)];
    for (k, gate) in l.gates.iter().enumerate() {
        want_views.push(view(*gate, z, 3 * k, 12));
    }
    assert_eq!(plan.views, want_views);
    assert_eq!(plan.in_place_concats, ids(&[l.state]));

    let pre = gs[0];
    assert_eq!(pre.nodes, ids(&[l.z_bias, l.z]));
    assert_eq!((pre.space, pre.width), (V, 12));
    assert_eq!(
        pre.inputs,
        vec![
            FusedInput {
                node: l.mm_x.id(),
                kind: InputKind::PerElement
            },
            FusedInput {
                node: l.b.id(),
                kind: InputKind::Broadcast
            },
            FusedInput {
                node: l.mm_h.id(),
                kind: InputKind::PerElement
            },
        ]
    );
    // z is read (through its four views) by the cell
    assert_eq!(pre.outputs, vec![z]);
    assert!(pre.concat_writes.is_empty());

    let cell = gs[1];
    assert_eq!(cell.nodes.len(), 9);
    assert_eq!((cell.space, cell.width), (V, 3));
    let mut want_inputs: Vec<FusedInput> = l
        .gates
        .iter()
        .enumerate()
        .map(|(k, gate)| FusedInput {
            node: gate.id(),
            kind: InputKind::Window {
                source: z,
                offset: 3 * k,
                stride: 12,
            },
        })
        .collect();
    want_inputs.push(FusedInput {
        node: l.c_prev.id(),
        kind: InputKind::Window {
            source: hc,
            offset: 3,
            stride: 6,
        },
    });
    assert_eq!(cell.inputs, want_inputs);
    // h is pushed; c only feeds tanh and the state, so it needs no buffer
    assert_eq!(cell.outputs, ids(&[l.h]));
    assert_eq!(
        cell.concat_writes,
        vec![
            ConcatWrite {
                member: l.c.id(),
                concat: l.state.id(),
                offset: 3,
                stride: 6
            },
            ConcatWrite {
                member: l.h.id(),
                concat: l.state.id(),
                offset: 0,
                stride: 6
            },
        ]
    );
    assert_eq!(cell.concat_targets(), ids(&[l.state]));

    // the matmuls read h_prev in place (the engine passes the window)
    let kinds: Vec<String> = plan
        .steps
        .iter()
        .map(|s| match s {
            Step::Op(v) => g.nodes[*v]
                .op()
                .map(|o| o.name())
                .unwrap_or("?")
                .to_string(),
            Step::Fused(grp) => format!("fused{}", grp.nodes.len()),
        })
        .collect();
    assert_eq!(kinds, ["matmul", "matmul", "fused2", "fused9"]);
    assert_eq!(g.nodes[l.mm_h.id()].inputs[0], l.h_prev.id());

    let env = lstm_env(&g, &shapes, 4, 1);
    check_plans_match_reference(&g, &env, &[&plan], &no_keep);

    let listing = plan.listing(&g, &["Wx".into(), "Wh".into(), "b".into()]);
    assert!(
        listing
            .starts_with("20 ops in 4 kernels (2 fused groups, 6 slice views, 1 concats in place)"),
        "{listing}"
    );
    assert!(listing.contains("fused vertex×3"), "{listing}");
    assert!(
        listing.contains("%7 = matmul[ABᵀ](%0, %4) : vertex[f[12]]"),
        "{listing}"
    );
    assert!(
        listing.contains(&format!("%{} window %{z}[0..3]/12", l.gates[0].id())),
        "{listing}"
    );
    assert!(
        listing.contains(&format!(
            "cat(%{}→%{}[3..6], %{}→%{}[0..3])",
            l.c.id(),
            l.state.id(),
            l.h.id(),
            l.state.id()
        )),
        "{listing}"
    );
    assert!(
        listing.contains(&format!(
            "view %{} = slice[3..6](%{hc}) : vertex[f[3]]",
            l.c_prev.id()
        )),
        "{listing}"
    );
    assert!(
        listing.contains(&format!(
            "in place %{} = concat(%{}, %{}) : vertex[f[6]]",
            l.state.id(),
            l.h.id(),
            l.c.id()
        )),
        "{listing}"
    );
    // one line per step, view and in-place concat
    assert_eq!(format!("{plan}").lines().count(), 4 + 6 + 1);
}

#[test]
fn lstm_cell_with_kept_slices_and_state_members_falls_back_to_copies() {
    // what the plan looked like before views: keeping the slices (say a
    // backward graph reads them) makes them steps again, with per-element
    // reads; keeping c makes it an output besides its concat write
    let (g, shapes, l) = lstm_cell(5, 3);
    let nodes = op_nodes(&g);
    let slices: Vec<NodeId> = ids(&[l.h_prev, l.c_prev])
        .into_iter()
        .chain(ids(&l.gates))
        .collect();
    let c = l.c.id();
    let keep = |v: NodeId| slices.contains(&v) || v == c;
    let plan = fuse(&g, &nodes, &keep).unwrap();
    check_plan(&g, &nodes, &keep, &plan);
    assert!(plan.views.is_empty());
    assert_eq!(plan.in_place_concats, ids(&[l.state]));
    // 6 slices, 2 matmuls, 2 groups; still no concat kernel
    assert_eq!(plan.kernel_launches(), 10, "{plan}");
    let cell = group_of(&plan, l.h.id());
    assert!(cell.inputs.iter().all(|i| i.kind == InputKind::PerElement));
    assert_eq!(cell.outputs, ids(&[l.c, l.h]));
    assert_eq!(cell.concat_writes.len(), 2);
    let env = lstm_env(&g, &shapes, 3, 9);
    check_plans_match_reference(&g, &env, &[&plan], &keep);
    // per-element reads and windows are different kernels
    let windowed = fuse_all(&g);
    let (a, b) = (
        cell.kernel(&g).unwrap(),
        group_of(&windowed, l.h.id()).kernel(&g).unwrap(),
    );
    assert_ne!(a.name, b.name);
    assert!(
        a.source.contains("const float a0 = in0[i];"),
        "{}",
        a.source
    );
}

#[test]
fn lstm_cell_kernel_source_has_one_kernel_with_the_expected_parameters() {
    let (g, _, l) = lstm_cell(5, 3);
    let plan = fuse_all(&g);
    let cell = group_of(&plan, l.h.id());
    let k = cell.kernel(&g).unwrap_or_else(|e| panic!("{e}"));
    let src = &k.source;
    assert_eq!(src.matches("__global__").count(), 1, "{src}");
    assert!(src.starts_with(&format!("extern \"C\" __global__ void {}(", k.name)));
    assert!(k.name.starts_with("fused_") && k.name.len() == "fused_".len() + 16);
    // parameters: pointers (inputs = window sources, outputs, concat
    // writes), n, width, then stride and offset per window and per write
    let mut params = Vec::new();
    params.extend((0..5).map(|p| format!("const float* __restrict__ in{p}")));
    params.push("float* __restrict__ out0".into());
    params.extend((0..2).map(|q| format!("float* cat{q}")));
    params.push("unsigned long long n".into());
    params.push("unsigned int width".into());
    for p in 0..5 {
        params.push(format!("unsigned int in{p}_stride"));
        params.push(format!("unsigned int in{p}_offset"));
    }
    for q in 0..2 {
        params.push(format!("unsigned int cat{q}_stride"));
        params.push(format!("unsigned int cat{q}_offset"));
    }
    let want_head = format!(
        "extern \"C\" __global__ void {}(\n    {})\n{{\n",
        k.name,
        params.join(",\n    ")
    );
    assert!(src.starts_with(&want_head), "{src}");
    for p in 0..5 {
        assert!(
            src.contains(&format!(
                "const float a{p} = in{p}[(i / width) * in{p}_stride + in{p}_offset + i % width];"
            )),
            "{src}"
        );
    }
    assert!(src.contains("i += (unsigned long long)gridDim.x * blockDim.x"));
    assert!(src.contains("(1.0f / (1.0f + expf(-a0)))"), "{src}");
    assert!(src.contains("tanhf(a3)"), "{src}");
    assert_eq!(src.matches("const float t").count(), 9);
    assert!(src.contains("out0[i] = t8;"), "{src}");
    assert!(
        src.contains("cat0[(i / width) * cat0_stride + cat0_offset + i % width] = t6;")
            && src.contains("cat1[(i / width) * cat1_stride + cat1_offset + i % width] = t8;"),
        "{src}"
    );
    assert!(!src.contains("out1") && !src.contains("cat2") && !src.contains("in5"));
    assert!(
        !src.contains('{') || !src.contains("{0}"),
        "unsubstituted placeholder"
    );

    let pre = group_of(&plan, l.z.id())
        .kernel(&g)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        pre.source.contains("const float a1 = in1[i % width];"),
        "{}",
        pre.source
    );
    assert!(pre.source.contains("const float t0 = (a0 + a1);"));
    assert!(pre.source.contains("const float t1 = (t0 + a2);"));
    assert!(
        !pre.source.contains("_stride") && !pre.source.contains("cat"),
        "{}",
        pre.source
    );
    assert_ne!(pre.name, k.name);
}

#[test]
fn lstm_cell_generated_kernels_compiled_for_the_host_match_op_by_op() {
    let (g, shapes, _) = lstm_cell(6, 8);
    let env = lstm_env(&g, &shapes, 5, 2);
    let plan = fuse_all(&g);
    check_codegen_on_host("lstm", &[(&g, &env, vec![&plan])]);
}

#[test]
fn identical_groups_share_a_kernel_name_and_signature() {
    let (g1, _, l1) = lstm_cell(5, 3);
    let (g2, _, l2) = lstm_cell(7, 16);
    let (p1, p2) = (fuse_all(&g1), fuse_all(&g2));
    let (c1, c2) = (group_of(&p1, l1.h.id()), group_of(&p2, l2.h.id()));
    let (k1, k2) = (c1.kernel(&g1).unwrap(), c2.kernel(&g2).unwrap());
    // the width is a run-time argument: both cells share one compiled kernel
    assert_eq!(k1, k2);
    assert_eq!(c1.signature(&g1).unwrap(), c2.signature(&g2).unwrap());
    // ... although the windows' strides and offsets differ (12 vs 64 columns)
    assert_ne!(c1.inputs, c2.inputs);
    assert_eq!(
        c1.signature(&g1).unwrap(),
        "in[a0:win,a1:win,a2:win,a3:win,a4:win] t0=sigmoid(a0) t1=sigmoid(a1) \
         t2=sigmoid(a2) t3=tanh(a3) t4=mul(t1,a4) t5=mul(t0,t3) t6=add(t4,t5) t7=tanh(t6) \
         t8=mul(t2,t7) out[t8] cat[t6,t8]"
    );
    let z = group_of(&p1, l1.z.id());
    assert_ne!(z.kernel(&g1).unwrap().name, k1.name);
    assert_ne!(z.signature(&g1).unwrap(), c1.signature(&g1).unwrap());
    // a different scalar attribute is a different kernel
    let scaled = |a: f64| {
        let mut b = GraphBuilder::new("s", &[]);
        let x = b.input(Source::Pull, rows(V, 2));
        let y = b.scale(x, a);
        b.output(Role::Push, y, None);
        let g = b.finish().unwrap();
        let plan = fuse_all(&g);
        let kernel = plan.groups().next().unwrap().kernel(&g).unwrap();
        kernel
    };
    assert_eq!(scaled(0.5), scaled(0.5));
    assert_ne!(scaled(0.5).name, scaled(0.25).name);
    assert!(scaled(-0.25).source.contains("(-0.25f * a0)"));
}

// ======================================================================
// What fuses and what does not
// ======================================================================

#[test]
fn a_diamond_through_a_non_elementwise_op_is_not_fused() {
    // a = tanh(x); m = a·W; b = a + m; c = σ(b): fusing a with b would make
    // the kernel wait for the matmul that waits for the kernel
    let mut b = GraphBuilder::new("diamond", &[vec![4, 4]]);
    let x = b.input(Source::Pull, rows(V, 4));
    let w = b.param(0);
    let a = b.tanh(x);
    let m = b.matmul(a, w, false, false);
    let s = b.add(a, m);
    let c = b.sigmoid(s);
    b.output(Role::Push, c, None);
    let g = b.finish().unwrap();
    let plan = fuse_all(&g);
    check_plan(&g, &op_nodes(&g), &no_keep, &plan);
    assert_eq!(plan.steps.len(), 3, "{plan}");
    assert!(
        matches!(&plan.steps[0], Step::Fused(f) if f.nodes == vec![a.id()] && f.outputs == vec![a.id()])
    );
    assert_eq!(plan.steps[1], Step::Op(m.id()));
    let Step::Fused(last) = &plan.steps[2] else {
        panic!("{plan}")
    };
    assert_eq!(last.nodes, ids(&[s, c]));
    assert_eq!(
        last.inputs.iter().map(|i| i.node).collect::<Vec<_>>(),
        ids(&[a, m])
    );
    // fusing across the matmul would indeed be cyclic
    let unit = |v: NodeId| {
        if v == s.id() || v == c.id() {
            a.id()
        } else {
            v
        }
    };
    assert!(steps_have_cycle(&g, &op_nodes(&g), &unit));

    let mut rng = Rng::new(3);
    let env = Env {
        topo: Topo::vertices(3),
        inputs: HashMap::from([(Source::Pull, Val::F(rng.vec(12, -1.0, 1.0)))]),
        params: vec![rng.vec(16, -1.0, 1.0)],
    };
    check_plans_match_reference(&g, &env, &[&plan], &no_keep);
}

#[test]
fn a_diamond_of_elementwise_ops_fuses_whole() {
    let mut b = GraphBuilder::new("diamond", &[]);
    let x = b.input(Source::Pull, rows(V, 4));
    let a = b.tanh(x);
    let l = b.sigmoid(a);
    let r = b.neg(a);
    let s = b.mul(l, r);
    b.output(Role::Push, s, None);
    let g = b.finish().unwrap();
    let plan = fuse_all(&g);
    assert_eq!(plan.steps.len(), 1);
    let grp = group_of(&plan, s.id());
    assert_eq!(grp.nodes, ids(&[a, l, r, s]));
    assert_eq!(grp.outputs, ids(&[s]));
}

#[test]
fn spaces_and_widths_are_never_fused_together() {
    // edge rows: a = σ(e), t = tanh(a); s = Σ_children t; vertex rows:
    // c = s + v, d = relu(c); back on edges: f = expand(d) * a — f and a
    // share space and width but a path a → t → s → c → d → expand → f
    // leaves the edge group, so f starts its own
    let mut b = GraphBuilder::new("spaces", &[vec![4], vec![2, 2]]);
    let e = b.input(Source::GatherAll, rows(E, 2));
    let v = b.input(Source::Pull, rows(V, 2));
    let a = b.sigmoid(e);
    let t = b.tanh(a);
    let s = b.sum_children(t);
    let c = b.add(s, v);
    let d = b.relu(c);
    let ex = b.expand_children(d);
    let f = b.mul(ex, a);
    let wide = b.concat(&[d, d]);
    let wide = b.tanh(wide);
    let back = b.slice(wide, 1, 2);
    let back = b.scale(back, 2.0);
    let p = b.param(1);
    let q0 = b.scale(p, 3.0);
    let q = b.add_scalar(q0, 1.0);
    b.output(Role::Push, back, None);
    b.output(Role::ChildGradAll, f, None);
    b.output(Role::Loss, q, None);
    let g = b.finish().unwrap();
    let plan = fuse_all(&g);
    check_plan(&g, &op_nodes(&g), &no_keep, &plan);
    let shape = |x: Sym| {
        let grp = group_of(&plan, x.id());
        (grp.nodes.clone(), grp.space, grp.width)
    };
    assert_eq!(shape(a), (ids(&[a, t]), E, 2));
    assert_eq!(shape(c), (ids(&[c, d]), V, 2));
    assert_eq!(shape(f), (ids(&[f]), E, 2));
    assert_eq!(shape(wide), (ids(&[wide]), V, 4));
    assert_eq!(shape(back), (ids(&[back]), V, 2));
    // a static chain fuses on its own: width is its element count
    assert_eq!(shape(q), (ids(&[q0, q]), Space::Static, 4));
    assert_eq!(groups(&plan).len(), 6);

    let mut rng = Rng::new(4);
    let topo = Topo::from_children(&[2, 0, 3]);
    let env = Env {
        inputs: HashMap::from([
            (Source::GatherAll, Val::F(rng.vec(10, -1.0, 1.0))),
            (Source::Pull, Val::F(rng.vec(6, -1.0, 1.0))),
        ]),
        params: vec![rng.vec(4, -1.0, 1.0), rng.vec(4, -1.0, 1.0)],
        topo,
    };
    check_plans_match_reference(&g, &env, &[&plan], &no_keep);
    let mut env32 = env.clone();
    round_to_f32(&mut env32);
    check_codegen_on_host("spaces", &[(&g, &env32, vec![&plan])]);
}

#[test]
fn static_operands_of_row_groups_are_broadcast_inputs() {
    // bias chain t = 2 b + 1 (static, its own group); y = x + t; z = tanh(y);
    // r = b1 * z with b1 a [1, w] parameter as the *first* operand
    let w = 3;
    let mut b = GraphBuilder::new("bias", &[vec![w], vec![1, w]]);
    let x = b.input(Source::Pull, rows(V, w));
    let (p, p1) = (b.param(0), b.param(1));
    let s = b.scale(p, 2.0);
    let t = b.add_scalar(s, 1.0);
    let y = b.add(x, t);
    let z = b.tanh(y);
    let r = b.mul(p1, z);
    let r2 = b.add(r, p);
    b.output(Role::Push, r2, None);
    let g = b.finish().unwrap();
    let plan = fuse_all(&g);
    check_plan(&g, &op_nodes(&g), &no_keep, &plan);
    let gs = groups(&plan);
    assert_eq!(gs.len(), 2, "{plan}");
    assert_eq!(gs[0].nodes, ids(&[s, t]));
    assert_eq!(gs[0].space, Space::Static);
    assert_eq!(
        gs[0].inputs,
        vec![FusedInput {
            node: p.id(),
            kind: InputKind::PerElement
        }]
    );
    assert_eq!(gs[0].outputs, ids(&[t]));
    assert_eq!(gs[1].nodes, ids(&[y, z, r, r2]));
    assert_eq!(
        gs[1].inputs,
        vec![
            FusedInput {
                node: x.id(),
                kind: InputKind::PerElement
            },
            FusedInput {
                node: t.id(),
                kind: InputKind::Broadcast
            },
            FusedInput {
                node: p1.id(),
                kind: InputKind::Broadcast
            },
            FusedInput {
                node: p.id(),
                kind: InputKind::Broadcast
            },
        ]
    );
    let src = gs[1].kernel(&g).unwrap().source;
    assert!(src.contains("const float a1 = in1[i % width];"), "{src}");
    assert!(src.contains("const float a2 = in2[i % width];"), "{src}");
    assert!(src.contains("const float a3 = in3[i % width];"), "{src}");
    assert!(src.contains("const float t2 = (a2 * t1);"), "{src}");

    let mut rng = Rng::new(5);
    let mut env = Env {
        topo: Topo::vertices(4),
        inputs: HashMap::from([(Source::Pull, Val::F(rng.vec(4 * w, -1.0, 1.0)))]),
        params: vec![rng.vec(w, -1.0, 1.0), rng.vec(w, -1.0, 1.0)],
    };
    check_plans_match_reference(&g, &env, &[&plan], &no_keep);
    round_to_f32(&mut env);
    check_codegen_on_host("bias", &[(&g, &env, vec![&plan])]);
}

#[test]
fn outputs_are_exactly_the_values_needed_outside() {
    // a = tanh x; b = σ a; c = a b; d = -c; e = d + 1 (pushed); m = b·W (reads b);
    // dead = exp a (read by nobody); c is kept (say, the backward graph reads it)
    let mut bld = GraphBuilder::new("outputs", &[vec![3, 3]]);
    let x = bld.input(Source::Pull, rows(V, 3));
    let wp = bld.param(0);
    let a = bld.tanh(x);
    let b = bld.sigmoid(a);
    let c = bld.mul(a, b);
    let d = bld.neg(c);
    let e = bld.add_scalar(d, 1.0);
    let m = bld.matmul(b, wp, false, false);
    let dead = bld.exp(a);
    bld.output(Role::Push, e, None);
    bld.output(Role::Scatter, m, None);
    let g = bld.finish().unwrap();
    let keep_c = |v: NodeId| v == c.id();
    let all = op_nodes(&g);
    let plan = fuse(&g, &all, &keep_c).unwrap();
    check_plan(&g, &all, &keep_c, &plan);
    let grp = group_of(&plan, a.id());
    assert_eq!(grp.nodes, ids(&[a, b, c, d, e, dead]));
    assert_eq!(grp.outputs, ids(&[b, c, e, dead]));
    // without keep, c stays in registers
    let plan = fuse_all(&g);
    assert_eq!(group_of(&plan, a.id()).outputs, ids(&[b, e, dead]));

    // split into two phases: values the second phase reads are materialized
    let (first, second): (Vec<NodeId>, Vec<NodeId>) = all
        .iter()
        .partition(|&&v| [a.id(), b.id(), c.id(), m.id()].contains(&v));
    let p1 = fuse(&g, &first, &no_keep).unwrap();
    let p2 = fuse(&g, &second, &no_keep).unwrap();
    check_plan(&g, &first, &no_keep, &p1);
    check_plan(&g, &second, &no_keep, &p2);
    assert_eq!(group_of(&p1, a.id()).outputs, ids(&[a, b, c]));
    // in the second phase `dead` no longer connects to d, e (a is computed before)
    assert_eq!(group_of(&p2, d.id()).nodes, ids(&[d, e]));
    assert_eq!(group_of(&p2, dead.id()).nodes, ids(&[dead]));
    assert_eq!(group_of(&p2, dead.id()).inputs[0].node, a.id());
    let mut rng = Rng::new(6);
    let env = Env {
        topo: Topo::vertices(2),
        inputs: HashMap::from([(Source::Pull, Val::F(rng.vec(6, -1.0, 1.0)))]),
        params: vec![rng.vec(9, -1.0, 1.0)],
    };
    check_plans_match_reference(&g, &env, &[&p1, &p2], &no_keep);
}

// ======================================================================
// Slices read in place, concats written in place
// ======================================================================

/// Random data for every float input of `g` over `topo`, parameters of `shapes`.
fn random_env(g: &Graph, shapes: &[Vec<usize>], topo: Topo, seed: u64) -> Env {
    let mut rng = Rng::new(seed);
    let mut env = Env {
        inputs: HashMap::new(),
        params: shapes
            .iter()
            .map(|s| rng.vec(s.iter().product(), -1.0, 1.0))
            .collect(),
        topo,
    };
    for node in &g.nodes {
        if let NodeKind::Input(s) = node.kind {
            let n = env.topo.len(&node.ty);
            env.inputs.insert(s, Val::F(rng.vec(n, -1.0, 1.0)));
        }
    }
    round_to_f32(&mut env);
    env
}

#[test]
fn sum_children_reads_a_slice_in_place() {
    // the child-sum of a slice of the gathered rows needs no copy of it
    let h = 3;
    let mut b = GraphBuilder::new("child-sum", &[]);
    let kids = b.input(Source::GatherAll, rows(E, 2 * h));
    let h_k = b.slice(kids, 0, h);
    let h_sum = b.sum_children(h_k);
    let out = b.tanh(h_sum);
    b.output(Role::Push, out, None);
    let g = b.finish().unwrap();
    let plan = fuse_all(&g);
    check_plan(&g, &op_nodes(&g), &no_keep, &plan);
    assert!(!plan.steps.contains(&Step::Op(h_k.id())), "{plan}");
    assert_eq!(
        plan.views,
        vec![SliceView {
            slice: h_k.id(),
            source: kids.id(),
            offset: 0,
            stride: 2 * h,
            len: h,
        }]
    );
}

#[test]
fn a_slice_read_by_a_non_fusable_op_stays_a_step() {
    // h_k = slice(kids), c_k = slice(kids); sum_rows(h_k) needs h_k in a
    // buffer of its own, so h_k is a step even though the matmul and the
    // gate could read it in place; c_k, only read by the gate group, is a
    // window of the gathered rows
    let h = 3;
    let shapes = vec![vec![h, h], vec![h]];
    let mut b = GraphBuilder::new("child-sum", &shapes);
    let kids = b.input(Source::GatherAll, rows(E, 2 * h));
    let h_k = b.slice(kids, 0, h);
    let c_k = b.slice(kids, h, h);
    let h_total = b.sum_rows(h_k);
    let (u, bias) = (b.param(0), b.param(1));
    let f_pre = b.linear(h_k, u, Some(bias));
    let f_k = b.sigmoid(f_pre);
    let fc = b.mul(f_k, c_k);
    let fc_sum = b.sum_children(fc);
    let out = b.add(fc_sum, h_total);
    b.output(Role::Push, out, None);
    let g = b.finish().unwrap();
    let plan = fuse_all(&g);
    check_plan(&g, &op_nodes(&g), &no_keep, &plan);
    assert!(plan.steps.contains(&Step::Op(h_k.id())), "{plan}");
    assert_eq!(
        plan.views,
        vec![SliceView {
            slice: c_k.id(),
            source: kids.id(),
            offset: h,
            stride: 2 * h,
            len: h,
        }]
    );
    let gate = group_of(&plan, fc.id());
    assert_eq!(
        gate.inputs.last(),
        Some(&FusedInput {
            node: c_k.id(),
            kind: InputKind::Window {
                source: kids.id(),
                offset: h,
                stride: 2 * h
            }
        })
    );
    // the matmul reads the materialized h_k, not a view
    assert!(plan.view(h_k.id()).is_none());
    let env = random_env(&g, &shapes, Topo::from_children(&[2, 0, 3]), 11);
    check_plans_match_reference(&g, &env, &[&plan], &no_keep);
    check_codegen_on_host("child-sum", &[(&g, &env, vec![&plan])]);

    // read in another phase, kept, or an output: a step as well
    let all = op_nodes(&g);
    let (first, second) = all.split_at(all.iter().position(|&v| v == fc.id()).unwrap_or(0));
    let p1 = fuse(&g, first, &no_keep).unwrap();
    assert!(p1.view(c_k.id()).is_none(), "{p1}");
    let keep_ck = |v: NodeId| v == c_k.id();
    let kept = fuse(&g, &all, &keep_ck).unwrap();
    check_plan(&g, &all, &keep_ck, &kept);
    assert!(kept.views.is_empty() && kept.steps.contains(&Step::Op(c_k.id())));
    let p2 = fuse(&g, second, &no_keep).unwrap();
    check_plans_match_reference(&g, &env, &[&p1, &p2], &no_keep);
}

#[test]
fn slices_feeding_matmuls_become_views_the_engine_passes_with_a_leading_dimension() {
    // y = slice(x)·W (A without trans_a), g = slice(x)ᵀ·slice(e) (both
    // operands of a trans_a matmul), and z = W·... is not possible for rows,
    // so a slice as B of a plain matmul never occurs
    let (d, h) = (5, 2);
    let shapes = vec![vec![h, 3]];
    let mut b = GraphBuilder::new("mm", &shapes);
    let x = b.input(Source::Pull, rows(V, d));
    let e = b.input(Source::Gather(0), rows(V, 4));
    let w = b.param(0);
    let xs = b.slice(x, 1, h);
    let es = b.slice(e, 1, 3);
    let y = b.matmul(xs, w, false, false);
    let gw = b.matmul(xs, es, true, false);
    b.output(Role::Push, y, None);
    b.output(Role::ParamGrad(0), gw, None);
    let g = b.finish().unwrap();
    let plan = fuse_all(&g);
    check_plan(&g, &op_nodes(&g), &no_keep, &plan);
    assert_eq!(plan.steps, vec![Step::Op(y.id()), Step::Op(gw.id())]);
    assert_eq!(
        plan.views,
        vec![
            SliceView {
                slice: xs.id(),
                source: x.id(),
                offset: 1,
                stride: d,
                len: h
            },
            SliceView {
                slice: es.id(),
                source: e.id(),
                offset: 1,
                stride: 4,
                len: 3
            },
        ]
    );
    assert_eq!(plan.kernel_launches(), 2);
    assert_eq!(plan.op_count(), 4);
    let listing = plan.listing(&g, &["W".into()]);
    assert!(
        listing.contains(&format!(
            "view %{} = slice[1..3](%{}) : vertex[f[2]]  (in place: columns 1..3 of %{}, stride 5)",
            xs.id(),
            x.id(),
            x.id()
        )),
        "{listing}"
    );
    let env = random_env(&g, &shapes, Topo::vertices(4), 12);
    check_plans_match_reference(&g, &env, &[&plan], &no_keep);
}

#[test]
fn a_concat_with_an_input_from_outside_any_group_stays_a_step() {
    // [tanh(x); x·W] — the matmul result is no group member — stays a
    // step; [t; σ(t)], both members of one group, is written in place;
    // [x; x] copies inputs
    let w = 3;
    let shapes = vec![vec![w, w]];
    let mut b = GraphBuilder::new("concat", &shapes);
    let x = b.input(Source::Pull, rows(V, w));
    let wm = b.param(0);
    let t = b.tanh(x);
    let m = b.matmul(x, wm, false, false);
    let mixed = b.concat(&[t, m]);
    let s = b.sigmoid(t);
    let both = b.concat(&[t, s]);
    let raw = b.concat(&[x, x]);
    b.output(Role::Push, mixed, None);
    b.output(Role::Scatter, both, None);
    b.output(Role::PullGrad, raw, None);
    let g = b.finish().unwrap();
    let plan = fuse_all(&g);
    check_plan(&g, &op_nodes(&g), &no_keep, &plan);
    assert!(plan.steps.contains(&Step::Op(mixed.id())), "{plan}");
    assert!(plan.steps.contains(&Step::Op(raw.id())), "{plan}");
    assert_eq!(plan.in_place_concats, ids(&[both]));
    let grp = group_of(&plan, t.id());
    assert_eq!(grp.nodes, ids(&[t, s]));
    // t is read by the concat that stays a step: it keeps its buffer; s
    // lives only in the concat
    assert_eq!(grp.outputs, ids(&[t]));
    assert_eq!(
        grp.concat_writes,
        vec![
            ConcatWrite {
                member: t.id(),
                concat: both.id(),
                offset: 0,
                stride: 2 * w
            },
            ConcatWrite {
                member: s.id(),
                concat: both.id(),
                offset: w,
                stride: 2 * w
            },
        ]
    );
    // readers of the in-place concat come after its writers
    let env = random_env(&g, &shapes, Topo::vertices(3), 13);
    check_plans_match_reference(&g, &env, &[&plan], &no_keep);
    check_codegen_on_host("concat", &[(&g, &env, vec![&plan])]);
}

#[test]
fn a_kept_member_written_into_a_concat_is_still_an_output() {
    // a = tanh x, b = σ a, c = a + b; state = [c; b] written in place; the
    // backward graph reads b (kept), c is pushed: both keep buffers, a stays
    // in registers; a reader of the state (relu) waits for the group
    let w = 2;
    let mut bld = GraphBuilder::new("kept", &[]);
    let x = bld.input(Source::Pull, rows(V, w));
    let a = bld.tanh(x);
    let b = bld.sigmoid(a);
    let c = bld.add(a, b);
    let state = bld.concat(&[c, b]);
    let r = bld.relu(state);
    bld.output(Role::Push, c, None);
    bld.output(Role::Scatter, r, None);
    let g = bld.finish().unwrap();
    let keep_b = |v: NodeId| v == b.id();
    let all = op_nodes(&g);
    let plan = fuse(&g, &all, &keep_b).unwrap();
    check_plan(&g, &all, &keep_b, &plan);
    assert_eq!(plan.in_place_concats, ids(&[state]));
    let grp = group_of(&plan, a.id());
    assert_eq!(grp.nodes, ids(&[a, b, c]));
    assert_eq!(grp.outputs, ids(&[b, c]));
    assert_eq!(
        grp.concat_writes
            .iter()
            .map(|w| (w.member, w.offset))
            .collect::<Vec<_>>(),
        vec![(b.id(), w), (c.id(), 0)]
    );
    // without keep, b lives only in the concat
    let plain = fuse_all(&g);
    assert_eq!(group_of(&plain, a.id()).outputs, ids(&[c]));
    // the relu reads the concat: its group comes after the writer
    assert_eq!(plan.steps.len(), 2);
    assert!(matches!(&plan.steps[1], Step::Fused(f) if f.nodes == ids(&[r])));
    let env = random_env(&g, &[], Topo::vertices(3), 14);
    check_plans_match_reference(&g, &env, &[&plan], &keep_b);
    check_codegen_on_host("kept", &[(&g, &env, vec![&plan, &plain])]);
}

#[test]
fn model_phases_fuse_into_valid_plans_that_keep_what_backward_reads() {
    let (vocab, h) = (7, 4);
    let mut m = ModelBuilder::new("tree-lstm", 2 * h);
    let emb = m.param("emb", &[vocab, h], Init::Normal { std: 0.1 });
    let u = m.param("U", &[3 * h, 2 * h], Init::Xavier);
    let wx = m.param("W", &[3 * h, h], Init::Xavier);
    let bias = m.param("b", &[3 * h], Init::Zeros);
    let w_out = m.param("W_out", &[2, h], Init::Xavier);
    let cell = m
        .vertex_fn("cell", |f| {
            let x = f.embed(emb);
            let (l, r) = (f.gather(0), f.gather(1));
            let hl = f.slice(l, 0, h);
            let hr = f.slice(r, 0, h);
            let cl = f.slice(l, h, h);
            let cr = f.slice(r, h, h);
            let hlr = f.concat(&[hl, hr]);
            let (u, wx, b) = (f.param(u), f.param(wx), f.param(bias));
            let zx = f.linear(x, wx, Some(b));
            let zh = f.linear(hlr, u, None);
            let z = f.add(zx, zh);
            let g = f.split(z, 3);
            let i = f.sigmoid(g[0]);
            let o = f.sigmoid(g[1]);
            let uu = f.tanh(g[2]);
            let cs = f.add(cl, cr);
            let iu = f.mul(i, uu);
            let c = f.add(iu, cs);
            let tc = f.tanh(c);
            let hh = f.mul(o, tc);
            let state = f.concat(&[hh, c]);
            f.scatter(state);
            f.push(hh);
        })
        .unwrap();
    m.select(ramus_core::FunctionSelector::Single(cell));
    m.head(HeadRows::Roots, h, |hd| {
        let x = hd.input();
        let w = hd.param(w_out);
        let logits = hd.linear(x, w, None);
        let labels = hd.labels();
        let l = hd.softmax_xent(logits, labels);
        let loss = hd.mean_rows(l);
        hd.loss(loss);
        hd.logits(logits);
    })
    .unwrap();
    let model = m.build().unwrap();
    let mut fused_ops = 0;
    for func in &model.functions {
        let keep_set = forward_reads(&func.backward);
        assert!(!keep_set.is_empty());
        let keep_fwd = |v: NodeId| keep_set.contains(&v);
        let sides: [(&Graph, _, &dyn Fn(NodeId) -> bool); 2] = [
            (&func.forward, &func.forward_plan, &keep_fwd),
            (&func.backward, &func.backward_plan, &no_keep),
        ];
        for (graph, plan, keep) in sides {
            let mut materialized = BTreeSet::new();
            for phase in [&plan.eager, &plan.per_task, &plan.lazy] {
                let fp = fuse(graph, phase, keep).unwrap_or_else(|e| panic!("{e}"));
                check_plan(graph, phase, keep, &fp);
                materialized.extend(fp.in_place_concats.iter().copied());
                for step in &fp.steps {
                    match step {
                        Step::Op(v) => {
                            materialized.insert(*v);
                        }
                        Step::Fused(grp) => {
                            materialized.extend(grp.outputs.iter().copied());
                            fused_ops += grp.nodes.len();
                            grp.kernel(graph).unwrap_or_else(|e| panic!("{e}"));
                        }
                    }
                }
            }
            for v in (0..graph.nodes.len()).filter(|&v| keep(v)) {
                if matches!(graph.nodes[v].kind, NodeKind::Op(_)) {
                    assert!(
                        materialized.contains(&v),
                        "%{v} read by backward is not materialized"
                    );
                }
            }
        }
    }
    assert!(fused_ops > 10);
    let head = &model.head.forward;
    let plan = fuse_all(head);
    check_plan(head, &op_nodes(head), &no_keep, &plan);
}

// ======================================================================
// Child sums and parent rows read inline; sibling groups
// ======================================================================

/// The reference child-sum Tree-LSTM (as `ramus-nn` builds it, without
/// dropout): a leaf function and the `internal` one, whose per-task phase
/// sums the children's `h` (read by a matmul) and their gated `c` (read by
/// the cell).
fn child_sum_tree_lstm(hd: usize) -> ramus_core::model::Model {
    let mut m = ModelBuilder::new("treelstm", 2 * hd);
    let emb = m.param("emb", &[7, hd], Init::Normal { std: 1.0 });
    let w_iou = m.param("W_iou", &[3 * hd, hd], Init::Xavier);
    let u_iou = m.param("U_iou", &[3 * hd, hd], Init::Xavier);
    let b_iou = m.param("b_iou", &[3 * hd], Init::Zeros);
    let u_f = m.param("U_f", &[hd, hd], Init::Xavier);
    let b_f = m.param("b_f", &[hd], Init::Zeros);
    let w_out = m.param("W_out", &[3, hd], Init::Xavier);
    let cell = |f: &mut ramus_core::model::VertexFnBuilder, iou: Sym, extra: Option<Sym>| {
        let parts = f.split(iou, 3);
        let i = f.sigmoid(parts[0]);
        let o = f.sigmoid(parts[1]);
        let u = f.tanh(parts[2]);
        let mut c = f.mul(i, u);
        if let Some(extra) = extra {
            c = f.add(c, extra);
        }
        let tc = f.tanh(c);
        let h = f.mul(o, tc);
        let state = f.concat(&[h, c]);
        f.scatter(state);
        f.push(h);
    };
    let leaf = m
        .vertex_fn("leaf", |f| {
            let x = f.embed(emb);
            let (w, b) = (f.param(w_iou), f.param(b_iou));
            let iou = f.linear(x, w, Some(b));
            cell(f, iou, None);
        })
        .unwrap();
    let internal = m
        .vertex_fn("internal", |f| {
            let kids = f.gather_all();
            let h_k = f.slice(kids, 0, hd);
            let c_k = f.slice(kids, hd, hd);
            let h_sum = f.sum_children(h_k);
            let (u, b) = (f.param(u_iou), f.param(b_iou));
            let iou = f.linear(h_sum, u, Some(b));
            let (uf, bf) = (f.param(u_f), f.param(b_f));
            let f_pre = f.linear(h_k, uf, Some(bf));
            let f_k = f.sigmoid(f_pre);
            let fc = f.mul(f_k, c_k);
            let fc_sum = f.sum_children(fc);
            cell(f, iou, Some(fc_sum));
        })
        .unwrap();
    m.select(ramus_core::FunctionSelector::LeafInternal { leaf, internal });
    m.head(HeadRows::Roots, hd, |h| {
        let x = h.input();
        let w = h.param(w_out);
        let logits = h.linear(x, w, None);
        let labels = h.labels();
        let l = h.softmax_xent(logits, labels);
        let loss = h.mean_rows(l);
        h.loss(loss);
        h.logits(logits);
    })
    .unwrap();
    m.build().unwrap()
}

/// Random data for every input of a vertex function's graph `g` over
/// `topo`; a backward graph's reads of the forward graph come from
/// `forward` (its op-by-op values). Rounded to f32.
fn function_env(
    g: &Graph,
    shapes: &[Vec<usize>],
    topo: &Topo,
    forward: Option<&[Val]>,
    seed: u64,
) -> Env {
    let mut rng = Rng::new(seed);
    let mut env = Env {
        topo: topo.clone(),
        inputs: HashMap::new(),
        params: shapes
            .iter()
            .map(|s| rng.vec(s.iter().product(), -0.5, 0.5))
            .collect(),
    };
    for node in &g.nodes {
        if let NodeKind::Input(s) = node.kind {
            let v = match (s, forward) {
                (Source::Forward(m), Some(fwd)) => fwd[m].clone(),
                _ => Val::F(rng.vec(env.topo.len(&node.ty), -1.0, 1.0)),
            };
            env.inputs.insert(s, v);
        }
    }
    round_to_f32(&mut env);
    env
}

/// The op nodes of `g` whose op passes `which`.
fn nodes_of(g: &Graph, which: fn(&Op) -> bool) -> Vec<NodeId> {
    op_nodes(g)
        .into_iter()
        .filter(|&v| op_at(g, v).is_some_and(which))
        .collect()
}

#[test]
fn child_sum_tree_lstm_reads_child_sums_and_parent_rows_inline() {
    let hd = 4;
    let model = child_sum_tree_lstm(hd);
    let func = model
        .functions
        .iter()
        .find(|f| f.name == "internal")
        .unwrap();
    let shapes: Vec<Vec<usize>> = model.params.iter().map(|p| p.shape.clone()).collect();
    let keep_set = forward_reads(&func.backward);
    let keep_fwd = |v: NodeId| keep_set.contains(&v);
    let (fg, bg) = (&func.forward, &func.backward);
    let fuse_phases =
        |g: &Graph, plan: &ramus_core::plan::ExecPlan, keep: &dyn Fn(NodeId) -> bool| {
            [&plan.eager, &plan.per_task, &plan.lazy].map(|phase| {
                let fp = fuse(g, phase, keep).unwrap_or_else(|e| panic!("{e}"));
                check_plan(g, phase, keep, &fp);
                fp
            })
        };

    // F: the child sum of the children's h feeds a matmul and stays a
    // step; the child sum of the gated c is read by the cell through the
    // CSR offsets (9 launches before)
    let fwd = fuse_phases(fg, &func.forward_plan, &keep_fwd);
    let f_task = &fwd[1];
    assert_eq!(f_task.kernel_launches(), 8, "{f_task}");
    let sums = nodes_of(fg, Op::is_child_sum);
    assert_eq!(sums.len(), 2);
    let (h_sum, fc_sum) = (sums[0], sums[1]);
    assert!(f_task.steps.contains(&Step::Op(h_sum)), "{f_task}");
    assert_eq!(f_task.inline_reads, vec![fc_sum]);
    let fc = fg.nodes[fc_sum].inputs[0];
    let cell = group_of(f_task, func.push.unwrap());
    assert_eq!(cell.space, V);
    assert!(
        cell.inputs.contains(&FusedInput {
            node: fc_sum,
            kind: InputKind::ChildSum { source: fc }
        }),
        "{cell:?}"
    );
    // the gated c is an output of the edge group that the cell reads
    assert!(group_of(f_task, fc).outputs.contains(&fc));
    let listing = f_task.listing(fg, &model.param_names());
    assert!(listing.contains(", 1 inline reads)"), "{listing}");
    assert!(
        listing.contains(&format!(
            "inline %{fc_sum} = sum_children(%{fc}) : vertex[f[{hd}]]  \
             (read by fused groups through CSR offsets)"
        )),
        "{listing}"
    );
    assert!(
        listing.contains(&format!("%{fc_sum} childsum %{fc}")),
        "{listing}"
    );

    // ∂F: both expansions are read inline, and the two products of the
    // first one share a kernel (8 launches before: 2 expansions, 2 groups
    // for the products)
    let bwd = fuse_phases(bg, &func.backward_plan, &no_keep);
    let b_task = &bwd[1];
    assert_eq!(b_task.kernel_launches(), 5, "{b_task}");
    let expands = nodes_of(bg, Op::is_expand_children);
    assert_eq!(expands.len(), 2);
    assert_eq!(b_task.inline_reads, expands);
    let users = bg.users();
    for &x in &expands {
        let source = bg.nodes[x].inputs[0];
        let grp = group_of(b_task, users[x][0]);
        assert!(users[x].iter().all(|u| grp.nodes.contains(u)));
        let reads: Vec<&FusedInput> = grp.inputs.iter().filter(|i| i.node == x).collect();
        assert_eq!(
            reads,
            [&FusedInput {
                node: x,
                kind: InputKind::ParentRow { source }
            }]
        );
    }
    let first = group_of(b_task, users[expands[0]][0]);
    assert_eq!(users[expands[0]].len(), 2, "{b_task}");
    assert_eq!(first.nodes.len(), 3, "{b_task}");
    assert!(
        b_task
            .listing(bg, &model.param_names())
            .contains("(read by fused groups through parent indices)"),
        "{}",
        b_task.listing(bg, &model.param_names())
    );

    // values: op by op against the plans, in f64 and as generated code
    let topo = Topo::from_children(&[2, 0, 3, 1, 1]);
    let f_env = function_env(fg, &shapes, &topo, None, 21);
    let f_plans: Vec<&FusionPlan> = fwd.iter().collect();
    check_plans_match_reference(fg, &f_env, &f_plans, &keep_fwd);
    let f_vals = reference(fg, &f_env);
    let b_env = function_env(bg, &shapes, &topo, Some(&f_vals), 22);
    let b_plans: Vec<&FusionPlan> = bwd.iter().collect();
    check_plans_match_reference(bg, &b_env, &b_plans, &no_keep);
    check_codegen_on_host("tree-lstm", &[(fg, &f_env, f_plans), (bg, &b_env, b_plans)]);

    // the same launches per task at the hidden size `ramus inspect` shows
    let big = child_sum_tree_lstm(256);
    let func = big.functions.iter().find(|f| f.name == "internal").unwrap();
    let keep_set = forward_reads(&func.backward);
    let f_task = fuse(&func.forward, &func.forward_plan.per_task, &|v| {
        keep_set.contains(&v)
    })
    .unwrap();
    let b_task = fuse(&func.backward, &func.backward_plan.per_task, &no_keep).unwrap();
    assert_eq!((f_task.kernel_launches(), b_task.kernel_launches()), (8, 5));
    assert_eq!(
        (f_task.inline_reads.len(), b_task.inline_reads.len()),
        (1, 2)
    );
}

#[test]
fn siblings_reading_one_expanded_row_fuse_into_one_kernel() {
    // the backward pattern: x = expand(v), a = x·p, b = x·q with a and b
    // read by different ops: without sibling merging two kernels and an
    // expand kernel, now one kernel reading v's rows through the parents
    let w = 3;
    let mut bld = GraphBuilder::new("siblings", &[]);
    let v = bld.input(Source::Pull, rows(V, w));
    let p = bld.input(Source::GatherAll, rows(E, w));
    let q = bld.input(Source::OutputGrad(0), rows(E, w));
    let vt = bld.tanh(v);
    let x = bld.expand_children(vt);
    let a = bld.mul(x, p);
    let b = bld.mul(x, q);
    let wide = bld.concat(&[a, p]);
    let s = bld.sum_children(b);
    bld.output(Role::ChildGradAll, wide, None);
    bld.output(Role::Push, s, None);
    let g = bld.finish().unwrap();
    let plan = fuse_all(&g);
    check_plan(&g, &op_nodes(&g), &no_keep, &plan);
    // tanh, [a b], concat (p is no member), child sum (a graph output)
    assert_eq!(plan.kernel_launches(), 4, "{plan}");
    assert_eq!(plan.inline_reads, ids(&[x]));
    let grp = group_of(&plan, a.id());
    assert_eq!(grp.nodes, ids(&[a, b]));
    assert_eq!(
        grp.inputs,
        vec![
            FusedInput {
                node: x.id(),
                kind: InputKind::ParentRow { source: vt.id() }
            },
            FusedInput {
                node: p.id(),
                kind: InputKind::PerElement
            },
            FusedInput {
                node: q.id(),
                kind: InputKind::PerElement
            },
        ]
    );
    assert_eq!(grp.outputs, ids(&[a, b]));
    let src = grp.kernel(&g).unwrap().source;
    assert_eq!(src.matches("in0_rows[").count(), 1, "{src}");
    assert!(
        src.contains(
            "const float a0 = in0[(unsigned long long)(in0_rows[i / width] - in0_base) \
             * width + i % width];"
        ),
        "{src}"
    );
    assert!(grp
        .signature(&g)
        .unwrap()
        .starts_with("in[a0:parent,a1:elem,a2:elem]"));
    assert!(
        format!("{plan}").contains(&format!("inline read %{}", x.id())),
        "{plan}"
    );
    let env = random_env(&g, &[], Topo::from_children(&[1, 3, 0, 2]), 23);
    check_plans_match_reference(&g, &env, &[&plan], &no_keep);
    check_codegen_on_host("siblings", &[(&g, &env, vec![&plan])]);
}

#[test]
fn siblings_whose_merge_would_wait_for_themselves_stay_apart() {
    // a = tanh x feeds a matmul m, and b = x + m: a and b read x, but one
    // kernel computing both would wait for m, which waits for a
    let w = 3;
    let mut bld = GraphBuilder::new("siblings", &[vec![w, w]]);
    let x = bld.input(Source::Pull, rows(V, w));
    let wm = bld.param(0);
    let a = bld.tanh(x);
    let m = bld.matmul(a, wm, false, false);
    let b = bld.add(x, m);
    // c reads x too and nothing orders it: it joins one of them
    let c = bld.sigmoid(x);
    let r = bld.concat(&[b, c]);
    let r = bld.sum_rows(r);
    bld.output(Role::Push, b, None);
    bld.output(Role::Loss, r, None);
    let g = bld.finish().unwrap();
    let plan = fuse_all(&g);
    check_plan(&g, &op_nodes(&g), &no_keep, &plan);
    assert_ne!(group_of(&plan, a.id()), group_of(&plan, b.id()), "{plan}");
    assert_eq!(group_of(&plan, a.id()).nodes, ids(&[a, c]), "{plan}");
    assert_eq!(plan.kernel_launches(), 4, "{plan}");
    let env = random_env(&g, &[vec![w, w]], Topo::vertices(3), 24);
    check_plans_match_reference(&g, &env, &[&plan], &no_keep);
}

#[test]
fn child_sums_and_expansions_stay_steps_unless_only_fused_ops_read_them() {
    let w = 3;
    let shapes = vec![vec![w, w]];
    let mut bld = GraphBuilder::new("inline", &shapes);
    let e = bld.input(Source::GatherAll, rows(E, w));
    let kids = bld.input(Source::Gather(0), rows(V, 2 * w));
    let wm = bld.param(0);
    let t = bld.tanh(e);
    // read by a matmul (and a fused op)
    let s_mm = bld.sum_children(t);
    let m = bld.matmul(s_mm, wm, false, false);
    let y1 = bld.add(m, s_mm);
    // read only by a fused op: inline
    let s_ok = bld.sum_children(t);
    let y2 = bld.neg(s_ok);
    // kept (the backward graph reads it)
    let s_kept = bld.sum_children(t);
    let y3 = bld.relu(s_kept);
    // a graph output
    let s_out = bld.sum_children(t);
    let y4 = bld.sigmoid(s_out);
    // of a viewed slice: the child-sum kernel reads it with a stride
    let ex = bld.expand_children(kids);
    let sl = bld.slice(ex, w, w);
    let s_view = bld.sum_children(sl);
    let y5 = bld.scale(s_view, 2.0);
    // read by a concat
    let s_wide = bld.sum_children(t);
    let y6 = bld.concat(&[s_wide, y5]);
    let y6 = bld.tanh(y6);
    // an expansion read by a fused op and by a child sum
    let ev = bld.expand_children(y2);
    let ea = bld.mul(ev, t);
    let es = bld.sum_children(ev);
    // an expansion read only by a fused edge op: inline
    let ev2 = bld.expand_children(y3);
    let eb = bld.add(ev2, e);
    let z = bld.add(y1, y4);
    bld.output(Role::Push, z, None);
    bld.output(Role::Scatter, s_out, None);
    bld.output(Role::ChildGradAll, ea, None);
    bld.output(Role::PullGrad, es, None);
    bld.output(Role::ChildGrad(0), eb, None);
    bld.output(Role::Loss, y6, None);
    let g = bld.finish().unwrap_or_else(|e| panic!("{e}"));
    let keep = |v: NodeId| v == s_kept.id();
    let all = op_nodes(&g);
    let plan = fuse(&g, &all, &keep).unwrap();
    check_plan(&g, &all, &keep, &plan);
    assert_eq!(plan.inline_reads, ids(&[s_ok, ev2]), "{plan}");
    for stepped in [s_mm, s_kept, s_out, s_view, s_wide, ev, ex] {
        assert!(
            plan.steps.contains(&Step::Op(stepped.id())),
            "%{} should be a step:\n{plan}",
            stepped.id()
        );
    }
    assert!(plan.view(sl.id()).is_some(), "{plan}");
    assert_eq!(
        group_of(&plan, y2.id()).inputs[0],
        FusedInput {
            node: s_ok.id(),
            kind: InputKind::ChildSum { source: t.id() }
        }
    );
    // without keep the kept one is read inline too
    let plain = fuse_all(&g);
    check_plan(&g, &all, &no_keep, &plain);
    assert_eq!(plain.inline_reads, ids(&[s_ok, s_kept, ev2]), "{plain}");
    // in another phase than its readers: a step
    let split = all.iter().position(|&v| v == y2.id()).unwrap();
    let p1 = fuse(&g, &all[..split], &no_keep).unwrap();
    let p2 = fuse(&g, &all[split..], &no_keep).unwrap();
    check_plan(&g, &all[..split], &no_keep, &p1);
    check_plan(&g, &all[split..], &no_keep, &p2);
    assert!(p1.steps.contains(&Step::Op(s_ok.id())), "{p1}");
    let env = random_env(&g, &shapes, Topo::from_children(&[2, 0, 1, 3]), 25);
    check_plans_match_reference(&g, &env, &[&plan], &keep);
    check_plans_match_reference(&g, &env, &[&p1, &p2], &no_keep);
    check_codegen_on_host("inline", &[(&g, &env, vec![&plan, &plain])]);
}

#[test]
fn inline_reads_have_their_index_arrays_and_bases_in_the_kernel_parameters() {
    // y = σ(Σ_children t) · v + ... : one child sum, one window, one
    // concat write, then an edge group reading a parent row
    let w = 2;
    let mut bld = GraphBuilder::new("abi", &[]);
    let e = bld.input(Source::GatherAll, rows(E, w));
    let hv = bld.input(Source::Gather(0), rows(V, 2 * w));
    let t = bld.tanh(e);
    let s = bld.sum_children(t);
    let hs = bld.slice(hv, w, w);
    let y = bld.sigmoid(s);
    let y = bld.mul(y, hs);
    let st = bld.concat(&[y, y]);
    let x = bld.expand_children(y);
    let z = bld.mul(x, e);
    bld.output(Role::Scatter, st, None);
    bld.output(Role::ChildGradAll, z, None);
    let g = bld.finish().unwrap();
    let plan = fuse_all(&g);
    check_plan(&g, &op_nodes(&g), &no_keep, &plan);
    assert_eq!(plan.inline_reads, ids(&[s, x]));
    let grp = group_of(&plan, y.id());
    assert!(
        matches!(
            grp.inputs[..],
            [
                FusedInput {
                    kind: InputKind::ChildSum { .. },
                    ..
                },
                FusedInput {
                    kind: InputKind::Window { .. },
                    ..
                }
            ]
        ),
        "{grp:?}"
    );
    let k = grp.kernel(&g).unwrap();
    let want_head = format!(
        "extern \"C\" __global__ void {}(\n    {})\n{{\n",
        k.name,
        [
            "const float* __restrict__ in0",
            "const float* __restrict__ in1",
            "float* __restrict__ out0",
            "float* cat0",
            "float* cat1",
            "const unsigned int* __restrict__ in0_rows",
            "unsigned long long n",
            "unsigned int width",
            "unsigned int in1_stride",
            "unsigned int in1_offset",
            "unsigned int cat0_stride",
            "unsigned int cat0_offset",
            "unsigned int cat1_stride",
            "unsigned int cat1_offset",
            "unsigned int in0_base",
        ]
        .join(",\n    ")
    );
    assert!(k.source.starts_with(&want_head), "{}", k.source);
    assert!(k.source.contains("float a0 = 0.0f;"), "{}", k.source);
    assert!(
        k.source
            .contains("a0 += in0[(unsigned long long)e * width + i % width];"),
        "{}",
        k.source
    );
    let edge = group_of(&plan, z.id()).kernel(&g).unwrap();
    assert!(
        edge.source
            .contains("unsigned long long n,\n    unsigned int width,\n    unsigned int in0_base)"),
        "{}",
        edge.source
    );
    assert_ne!(edge.name, k.name);
    let env = random_env(&g, &[], Topo::from_children(&[0, 2, 3]), 26);
    check_plans_match_reference(&g, &env, &[&plan], &no_keep);
    check_codegen_on_host("abi", &[(&g, &env, vec![&plan])]);
}

#[test]
fn bad_index_arrays_and_hand_made_inline_reads_are_errors_naming_the_input() {
    let w = 2;
    let mut bld = GraphBuilder::new("csr", &[]);
    let e = bld.input(Source::GatherAll, rows(E, w));
    let v = bld.input(Source::Pull, rows(V, w));
    let s = bld.sum_children(e);
    let y = bld.add(s, v);
    let x = bld.expand_children(y);
    let z = bld.mul(x, e);
    bld.output(Role::Push, y, None);
    bld.output(Role::ChildGradAll, z, None);
    let g = bld.finish().unwrap();
    let plan = fuse_all(&g);
    check_plan(&g, &op_nodes(&g), &no_keep, &plan);
    assert_eq!(plan.inline_reads, ids(&[s, x]));
    let vg = group_of(&plan, y.id()).clone();
    let eg = group_of(&plan, z.id()).clone();
    // 2 vertices with 2 and 1 children
    let (src, vin) = (vec![1.0f64; 3 * w], vec![0.5f64; 2 * w]);
    let mut out = vec![0.0f64; 2 * w];
    let call = |offsets: &[u32], src: &[f64], out: &mut [f64]| {
        eval_group::<f64>(&vg, &g, &[src, &vin], &[offsets], 2, &mut [out], &mut [])
            .map_err(|e| e.to_string())
    };
    assert_eq!(call(&[0, 2, 3], &src, &mut out), Ok(()));
    assert_eq!(out, [2.5, 2.5, 1.5, 1.5]);
    let msg = call(&[0, 2], &src, &mut out).unwrap_err();
    assert!(
        msg.contains(&format!("input 0 (%{}, csum)", s.id()))
            && msg.contains("has 2 CSR offsets, expected 2 + 1"),
        "{msg}"
    );
    let msg = call(&[0, 2, 4], &src, &mut out).unwrap_err();
    assert!(
        msg.contains("row 1 sums edges 2..4") && msg.contains("3 edge rows"),
        "{msg}"
    );
    let msg = call(&[2, 1, 3], &src, &mut out).unwrap_err();
    assert!(msg.contains("row 0 sums edges 2..1"), "{msg}");
    let msg = call(&[0, 2, 3], &src[1..], &mut out).unwrap_err();
    assert!(msg.contains("not whole rows of width 2"), "{msg}");
    let msg = eval_group::<f64>(&vg, &g, &[&src, &vin], &[], 2, &mut [&mut out], &mut [])
        .unwrap_err()
        .to_string();
    assert!(msg.contains("1 index arrays"), "{msg}");

    let (parents_src, ein) = (vec![1.0f64; 2 * w], vec![1.0f64; 3 * w]);
    let mut eout = vec![0.0f64; 3 * w];
    let ecall = |parents: &[u32], eout: &mut [f64]| {
        eval_group::<f64>(
            &eg,
            &g,
            &[&parents_src, &ein],
            &[parents],
            3,
            &mut [eout],
            &mut [],
        )
        .map_err(|e| e.to_string())
    };
    assert_eq!(ecall(&[0, 0, 1], &mut eout), Ok(()));
    let msg = ecall(&[0, 2, 1], &mut eout).unwrap_err();
    assert!(
        msg.contains(&format!("input 0 (%{}, parent)", x.id()))
            && msg.contains("edge 1 has parent row 2"),
        "{msg}"
    );
    let msg = ecall(&[0, 1], &mut eout).unwrap_err();
    assert!(msg.contains("2 parent rows, expected 3"), "{msg}");

    // hand-made groups whose inline inputs do not say what they read
    let mut broken = vg.clone();
    broken.inputs[0].kind = InputKind::ChildSum { source: v.id() };
    let msg = broken.kernel(&g).unwrap_err().to_string();
    assert!(
        msg.contains(&format!("is not sum_children(%{})", v.id())),
        "{msg}"
    );
    let mut broken = vg.clone();
    broken.inputs[0].kind = InputKind::ParentRow { source: e.id() };
    let msg = broken.kernel(&g).unwrap_err().to_string();
    assert!(
        msg.contains(&format!("is not expand_children(%{})", e.id())),
        "{msg}"
    );
    let mut broken = eg.clone();
    broken.inputs[0] = FusedInput {
        node: s.id(),
        kind: InputKind::ChildSum { source: e.id() },
    };
    let msg = broken.kernel(&g).unwrap_err().to_string();
    assert!(msg.contains("expected Vertex"), "{msg}");
}

// ======================================================================
// Errors
// ======================================================================

#[test]
fn bad_node_lists_and_bad_buffers_are_errors_naming_the_node() {
    let (g, _, l) = lstm_cell(2, 2);
    let all = op_nodes(&g);
    let err = |nodes: &[NodeId]| fuse(&g, nodes, &no_keep).unwrap_err().to_string();
    let msg = err(&[l.x.id()]);
    assert!(
        msg.contains(&format!("%{}", l.x.id())) && msg.contains("not an op"),
        "{msg}"
    );
    let msg = err(&[all[0], all[0]]);
    assert!(msg.contains("twice"), "{msg}");
    let msg = err(&[l.z.id(), l.z_bias.id()]);
    assert!(
        msg.contains(&format!("%{}", l.z.id())) && msg.contains("listed after"),
        "{msg}"
    );
    let msg = err(&[9999]);
    assert!(
        msg.contains("%9999") && msg.contains("does not exist"),
        "{msg}"
    );
    // z reads z_bias, which is unlisted but depends on the listed matmul
    let msg = err(&[l.mm_x.id(), l.z.id()]);
    assert!(msg.contains("not listed but depends"), "{msg}");
    // a listed node may read unlisted values computed before (another phase)
    assert!(fuse(&g, &[l.z.id()], &no_keep).is_ok());

    let plan = fuse_all(&g);
    let grp = group_of(&plan, l.z.id()).clone();
    let (a, b) = (vec![0.0f32; 8], vec![0.0f32; 8]);
    let mut out = vec![0.0f32; 8];
    let msg = eval_group::<f32>(&grp, &g, &[&a, &b], &[], 1, &mut [&mut out], &mut [])
        .unwrap_err()
        .to_string();
    assert!(msg.contains("takes 3 inputs"), "{msg}");
    let bias_wrong = vec![0.0f32; 3];
    let msg = eval_group::<f32>(
        &grp,
        &g,
        &[&a, &bias_wrong, &b],
        &[],
        1,
        &mut [&mut out],
        &mut [],
    )
    .unwrap_err()
    .to_string();
    assert!(
        msg.contains("input 1") && msg.contains("expected 8"),
        "{msg}"
    );
    let mut short = vec![0.0f32; 7];
    let bias = vec![0.0f32; 8];
    let msg = eval_group::<f32>(
        &grp,
        &g,
        &[&a, &bias, &b],
        &[],
        1,
        &mut [&mut short],
        &mut [],
    )
    .unwrap_err()
    .to_string();
    assert!(msg.contains("output 0"), "{msg}");

    // the cell reads windows of z (8 wide) and hc (4 wide), writes [h; c]
    let cell = group_of(&plan, l.h.id()).clone();
    let (z8, hc4) = (vec![0.5f32; 2 * 8], vec![0.5f32; 2 * 4]);
    let mut h = vec![0.0f32; 2 * 2];
    let mut state = vec![0.0f32; 2 * 4];
    let ok = eval_group::<f32>(
        &cell,
        &g,
        &[&z8, &z8, &z8, &z8, &hc4],
        &[],
        2,
        &mut [&mut h],
        &mut [&mut state],
    );
    assert!(ok.is_ok(), "{ok:?}");
    assert_eq!(&state[..2], &h[..2], "h goes to columns 0..2 of the state");
    let msg = eval_group::<f32>(
        &cell,
        &g,
        &[&z8, &z8, &z8, &z8, &z8],
        &[],
        2,
        &mut [&mut h],
        &mut [&mut state],
    )
    .unwrap_err()
    .to_string();
    assert!(
        msg.contains("input 4") && msg.contains("expected 8"),
        "{msg}"
    );
    let msg = eval_group::<f32>(
        &cell,
        &g,
        &[&z8, &z8, &z8, &z8, &hc4],
        &[],
        2,
        &mut [&mut h],
        &mut [],
    )
    .unwrap_err()
    .to_string();
    assert!(msg.contains("1 concat buffers"), "{msg}");
    let mut short_state = vec![0.0f32; 7];
    let msg = eval_group::<f32>(
        &cell,
        &g,
        &[&z8, &z8, &z8, &z8, &hc4],
        &[],
        2,
        &mut [&mut h],
        &mut [&mut short_state],
    )
    .unwrap_err()
    .to_string();
    assert!(msg.contains("concat buffer 0"), "{msg}");
    // hand-made windows and writes that do not fit are errors, not panics
    let mut broken = cell.clone();
    broken.inputs[4].kind = InputKind::Window {
        source: l.hc.id(),
        offset: 3,
        stride: 4,
    };
    let msg = broken.kernel(&g).unwrap_err().to_string();
    assert!(msg.contains("do not fit"), "{msg}");
    let mut broken = cell.clone();
    broken.inputs[4].kind = InputKind::Window {
        source: l.hc.id(),
        offset: 0,
        stride: 8,
    };
    let msg = broken.kernel(&g).unwrap_err().to_string();
    assert!(msg.contains("expected Vertex rows of width 8"), "{msg}");
    let mut broken = cell.clone();
    broken.concat_writes[0].member = l.mm_x.id();
    let msg = broken.signature(&g).unwrap_err().to_string();
    assert!(msg.contains("not a member"), "{msg}");
    let mut broken = cell;
    broken.concat_writes[0].offset = 3;
    let msg = eval_group::<f32>(
        &broken,
        &g,
        &[&z8, &z8, &z8, &z8, &hc4],
        &[],
        2,
        &mut [&mut h],
        &mut [&mut state],
    )
    .unwrap_err()
    .to_string();
    assert!(msg.contains("do not fit"), "{msg}");
    // a hand-made group that reads a value it does not declare
    let mut broken = grp.clone();
    broken.inputs.pop();
    let msg = broken.kernel(&g).unwrap_err().to_string();
    assert!(
        msg.contains("neither an earlier member nor an input"),
        "{msg}"
    );
    let mut broken = grp;
    broken.nodes.insert(0, l.mm_x.id());
    let msg = broken.signature(&g).unwrap_err().to_string();
    assert!(msg.contains("no elementwise template"), "{msg}");
}

// ======================================================================
// Every registered elementwise op through code generation
// ======================================================================

#[test]
fn every_registered_elementwise_op_compiles_and_matches_its_kernel() {
    let reg = OpRegistry::standard();
    let w = 5;
    let mut cases: Vec<(Graph, Env, FusionPlan)> = Vec::new();
    let mut names = BTreeSet::new();
    for name in reg.names() {
        for arity in [1, 2] {
            // operand layouts: all rows; for binary ops also a broadcast bias on either side
            let layouts: &[&[bool]] = if arity == 1 {
                &[&[true]]
            } else {
                &[&[true, true], &[true, false], &[false, true]]
            };
            for layout in layouts {
                let mut b = GraphBuilder::new(name, &[vec![w]]);
                let sources = [Source::Pull, Source::Gather(0)];
                let ins: Vec<Sym> = layout
                    .iter()
                    .enumerate()
                    .map(|(k, &row)| {
                        if row {
                            b.input(sources[k], rows(V, w))
                        } else {
                            b.param(0)
                        }
                    })
                    .collect();
                let y = reg.call(&mut b, name, &ins, &[-0.75]);
                b.output(Role::Push, y, None);
                let Ok(g) = b.finish() else { continue };
                let Some(op) = g.nodes[y.id()].op() else {
                    continue;
                };
                if op.elementwise_template().is_none() {
                    continue;
                }
                names.insert(name.to_string());
                let mut rng = Rng::new(names.len() as u64);
                let topo = Topo::vertices(3);
                let mut env = Env {
                    topo: topo.clone(),
                    inputs: HashMap::new(),
                    params: vec![],
                };
                let sample = |rng: &mut Rng, n: usize| {
                    if name == "log" {
                        rng.vec(n, 0.2, 2.0)
                    } else {
                        rng.vec_away(n, 0.2, 2.0)
                    }
                };
                env.params.push(sample(&mut rng, w));
                for (k, &row) in layout.iter().enumerate() {
                    if row {
                        let data = sample(&mut rng, topo.len(&rows(V, w)));
                        env.inputs.insert(sources[k], Val::F(data));
                    }
                }
                round_to_f32(&mut env);
                let plan = fuse_all(&g);
                assert_eq!(plan.steps.len(), 1);
                check_plans_match_reference(&g, &env, &[&plan], &no_keep);
                cases.push((g, env, plan));
            }
        }
    }
    for want in [
        "neg",
        "exp",
        "log",
        "sigmoid",
        "tanh",
        "relu",
        "scale",
        "add_scalar",
        "rsub_scalar",
        "add",
        "sub",
        "mul",
        "div",
        "sigmoid_backward",
        "tanh_backward",
        "relu_backward",
    ] {
        assert!(
            names.contains(want),
            "{want} not exercised (found {names:?})"
        );
    }
    let cases: Vec<(&Graph, &Env, Vec<&FusionPlan>)> =
        cases.iter().map(|(g, e, p)| (g, e, vec![p])).collect();
    check_codegen_on_host("every-op", &cases);
}

// ======================================================================
// Random elementwise DAGs
// ======================================================================

/// A random graph: vertex rows of one width from two inputs (and a wider
/// third one to slice), elementwise ops of every kind, static bias chains,
/// and non-elementwise ops (matmul, concat/slice changing width, sum_rows,
/// trips through edge rows) that split groups and create diamonds; slices
/// at any column of inputs, of group outputs and of concats that groups
/// write in place, read by groups, by matmuls (plain and transposed) and by
/// ops that cannot read them in place; child sums and expansions read by
/// fused ops only (inline), by matmuls, or of viewed slices; sibling
/// chains reading one value; two phases and a random `keep`.
#[derive(Clone, Debug)]
struct DagSpec {
    width: usize,
    children: Vec<usize>,
    ops: Vec<(u8, usize, usize)>,
    split: usize,
    keep_bits: u64,
    scatter: usize,
    seed: u64,
}

fn dag_spec() -> impl Strategy<Value = DagSpec> {
    (
        1usize..=4,
        prop::collection::vec(0usize..3, 1..=4),
        prop::collection::vec((0u8..28, any::<usize>(), any::<usize>()), 1..16),
        any::<usize>(),
        any::<u64>(),
        any::<usize>(),
        any::<u64>(),
    )
        .prop_map(
            |(width, children, ops, split, keep_bits, scatter, seed)| DagSpec {
                width,
                children,
                ops,
                split,
                keep_bits,
                scatter,
                seed,
            },
        )
}

struct Dag {
    graph: Graph,
    env: Env,
    phases: [Vec<NodeId>; 2],
    keep: Vec<bool>,
}

fn build_dag(spec: &DagSpec) -> Dag {
    let w = spec.width;
    let shapes = vec![vec![w], vec![w, w]];
    let mut b = GraphBuilder::new("dag", &shapes);
    let x = b.input(Source::Pull, rows(V, w));
    let hprev = b.input(Source::Gather(0), rows(V, w));
    let wide_in = b.input(Source::Gather(1), rows(V, 3 * w));
    let (bias, wmat) = (b.param(0), b.param(1));
    let mut pool = vec![x, hprev];
    let mut statics = vec![bias];
    for &(kind, i, j) in &spec.ops {
        let (p, q) = (pool[i % pool.len()], pool[j % pool.len()]);
        let s = statics[j % statics.len()];
        let y = match kind {
            0 => b.neg(p),
            1 => b.sigmoid(p),
            2 => b.tanh(p),
            3 => b.relu(p),
            4 => b.scale(p, 0.5),
            5 => b.add_scalar(p, 0.25),
            6 => b.rsub_scalar(p, 1.0),
            7 => b.add(p, q),
            8 => b.sub(p, q),
            9 => b.mul(p, q),
            10 => b.sigmoid_backward(p, q),
            11 => b.tanh_backward(p, q),
            12 => b.relu_backward(p, q),
            13 => b.add(p, s),
            14 => b.mul(s, p),
            15 => {
                let t = b.scale(s, -0.5);
                statics.push(t);
                continue;
            }
            16 => {
                let r = b.sum_rows(p);
                let r = b.tanh(r);
                statics.push(r);
                continue;
            }
            17 => b.matmul(p, wmat, false, false),
            18 => {
                let wide = b.concat(&[p, q]);
                let wide = b.tanh(wide);
                let wide = b.mul(wide, wide);
                b.slice(wide, (i % 2) * w, w)
            }
            19 => {
                let e = b.expand_children(p);
                let e = b.sigmoid(e);
                let e = b.add_scalar(e, -0.5);
                b.sum_children(e)
            }
            // a concat of two values (written in place when both are
            // fused), sliced back at any column
            20 => {
                let wide = b.concat(&[p, q]);
                let s = b.slice(wide, i % (w + 1), w);
                b.add_scalar(s, 0.5)
            }
            // a member written twice into one concat
            21 => {
                let wide = b.concat(&[q, p, q]);
                let s = b.slice(wide, j % (2 * w + 1), w);
                b.mul(s, p)
            }
            // a slice of a wide input
            22 => {
                let s = b.slice(wide_in, i % (2 * w + 1), w);
                b.neg(s)
            }
            // slices as both operands of a transposed matmul, then as A
            23 => {
                let wide = b.concat(&[p, q]);
                let sa = b.slice(wide, i % (w + 1), w);
                let sb = b.slice(wide_in, j % (2 * w + 1), w);
                let m = b.matmul(sa, sb, true, false);
                let m = b.scale(m, 0.25);
                b.matmul(sa, m, false, false)
            }
            // sibling chains reading one expanded row, summed back
            25 => {
                let e = b.expand_children(p);
                let l = b.tanh(e);
                let r = b.sigmoid(e);
                let (sl, sr) = (b.sum_children(l), b.sum_children(r));
                b.sub(sl, sr)
            }
            // the child sum of a viewed slice of a wide expansion
            26 => {
                let wide = b.concat(&[p, q]);
                let e = b.expand_children(wide);
                let s = b.slice(e, i % (w + 1), w);
                let s = b.sum_children(s);
                b.add(s, q)
            }
            // a child sum read by a matmul and by a fused op
            27 => {
                let e = b.expand_children(p);
                let e = b.mul(e, e);
                let s = b.sum_children(e);
                let m = b.matmul(s, wmat, false, false);
                b.add(m, s)
            }
            // a slice read in place and by an op that cannot
            _ => {
                let s = b.slice(wide_in, j % (2 * w + 1), w);
                let r = b.sum_rows(s);
                statics.push(r);
                b.tanh(s)
            }
        };
        pool.push(y);
    }
    let last = pool[pool.len() - 1];
    b.output(Role::Push, last, None);
    b.output(Role::Scatter, pool[spec.scatter % pool.len()], None);
    let graph = b.finish().unwrap_or_else(|e| panic!("test bug: {e}"));
    let ops = op_nodes(&graph);
    let split = spec.split % (ops.len() + 1);
    let phases = [ops[..split].to_vec(), ops[split..].to_vec()];
    let keep = (0..graph.nodes.len())
        .map(|i| (spec.keep_bits >> ((2 * i) % 64)) & 3 == 0)
        .collect();
    let mut rng = Rng::new(spec.seed);
    let topo = Topo::from_children(&spec.children);
    let mut env = Env {
        inputs: HashMap::from([
            (
                Source::Pull,
                Val::F(rng.vec(topo.len(&rows(V, w)), -1.0, 1.0)),
            ),
            (
                Source::Gather(0),
                Val::F(rng.vec(topo.len(&rows(V, w)), -1.0, 1.0)),
            ),
            (
                Source::Gather(1),
                Val::F(rng.vec(topo.len(&rows(V, 3 * w)), -1.0, 1.0)),
            ),
        ]),
        params: vec![rng.vec(w, -1.0, 1.0), rng.vec(w * w, -0.7, 0.7)],
        topo,
    };
    round_to_f32(&mut env);
    Dag {
        graph,
        env,
        phases,
        keep,
    }
}

fn fuse_dag(dag: &Dag) -> [FusionPlan; 2] {
    let keep = |v: NodeId| dag.keep[v];
    let plan = |nodes: &[NodeId]| {
        let p = fuse(&dag.graph, nodes, &keep).unwrap_or_else(|e| panic!("fuse: {e}"));
        check_plan(&dag.graph, nodes, &keep, &p);
        p
    };
    [plan(&dag.phases[0]), plan(&dag.phases[1])]
}

proptest! {
    #![proptest_config(Config { cases: 96, ..Config::default() })]

    /// Plans cover every node once in dependency order, groups are
    /// well formed and maximal, and the CPU interpreter running the plans
    /// reproduces op-by-op evaluation for every materialized value.
    #[test]
    fn random_dags_fuse_into_valid_plans_that_preserve_semantics(spec in dag_spec()) {
        let dag = build_dag(&spec);
        let [p1, p2] = fuse_dag(&dag);
        let keep = |v: NodeId| dag.keep[v];
        check_plans_match_reference(&dag.graph, &dag.env, &[&p1, &p2], &keep);
    }
}

/// Connected parts of `grp` through its members' reads of each other: more
/// than one only when sibling groups were merged.
fn member_components(g: &Graph, grp: &FusedGroup) -> usize {
    let mut part: Vec<usize> = (0..grp.nodes.len()).collect();
    fn root(part: &[usize], mut i: usize) -> usize {
        while part[i] != i {
            i = part[i];
        }
        i
    }
    for (j, &m) in grp.nodes.iter().enumerate() {
        for x in &g.nodes[m].inputs {
            if let Some(k) = grp.nodes.iter().position(|y| y == x) {
                let (a, b) = (root(&part, j), root(&part, k));
                part[a] = b;
            }
        }
    }
    (0..part.len()).filter(|&i| part[i] == i).count()
}

/// Generated kernels of random DAGs drawn from the same strategy, compiled
/// once for the host and compared with op-by-op evaluation.
#[test]
fn random_dag_kernels_compiled_for_the_host_match_op_by_op() {
    let mut runner = TestRunner::deterministic();
    let strategy = dag_spec();
    let dags: Vec<Dag> = (0..40)
        .map(|_| {
            let spec = strategy
                .new_tree(&mut runner)
                .unwrap_or_else(|e| panic!("{e}"))
                .current();
            build_dag(&spec)
        })
        .collect();
    let plans: Vec<[FusionPlan; 2]> = dags.iter().map(fuse_dag).collect();
    // the sample exercises every in-place form
    let (mut windows, mut writes, mut twice, mut matmul_views, mut kept_slices) = (0, 0, 0, 0, 0);
    let (mut child_sums, mut parent_rows, mut csr_steps, mut siblings) = (0, 0, 0, 0);
    for (d, ps) in dags.iter().zip(&plans) {
        for p in ps {
            csr_steps += p
                .steps
                .iter()
                .filter(|s| {
                    matches!(s, Step::Op(v) if matches!(op_at(&d.graph, *v), Some(Op::SumChildren(_)))
                        || matches!(op_at(&d.graph, *v), Some(Op::ExpandChildren(_))))
                })
                .count();
            for grp in p.groups() {
                child_sums += grp
                    .inputs
                    .iter()
                    .filter(|i| matches!(i.kind, InputKind::ChildSum { .. }))
                    .count();
                parent_rows += grp
                    .inputs
                    .iter()
                    .filter(|i| matches!(i.kind, InputKind::ParentRow { .. }))
                    .count();
                if member_components(&d.graph, grp) > 1 {
                    siblings += 1;
                }
                windows += grp
                    .inputs
                    .iter()
                    .filter(|i| matches!(i.kind, InputKind::Window { .. }))
                    .count();
                writes += grp.concat_writes.len();
                twice += grp
                    .concat_writes
                    .windows(2)
                    .filter(|w| w[0].member == w[1].member && w[0].concat == w[1].concat)
                    .count();
            }
            for v in &p.views {
                let users = d.graph.users();
                matmul_views += users[v.slice]
                    .iter()
                    .filter(|&&u| matches!(op_at(&d.graph, u), Some(Op::MatMul(_))))
                    .count();
            }
            kept_slices += p
                .steps
                .iter()
                .filter(|s| matches!(s, Step::Op(v) if matches!(op_at(&d.graph, *v), Some(Op::Slice(_)))))
                .count();
        }
    }
    assert!(
        windows > 10 && writes > 10 && twice > 0 && matmul_views > 2 && kept_slices > 2,
        "windows {windows}, concat writes {writes}, twice {twice}, \
         matmul views {matmul_views}, slice steps {kept_slices}"
    );
    assert!(
        child_sums > 5 && parent_rows > 5 && csr_steps > 5 && siblings > 2,
        "child sums {child_sums}, parent rows {parent_rows}, \
         child sum / expand steps {csr_steps}, sibling groups {siblings}"
    );
    let cases: Vec<(&Graph, &Env, Vec<&FusionPlan>)> = dags
        .iter()
        .zip(&plans)
        .map(|(d, [p1, p2])| (&d.graph, &d.env, vec![p1, p2]))
        .collect();
    let checked = check_codegen_on_host("random", &cases);
    assert!(checked == 0 || checked > 40, "only {checked} kernels");
}
