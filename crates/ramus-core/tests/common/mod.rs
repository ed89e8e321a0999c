//! Test support: a deterministic PRNG, a tiny reference interpreter for
//! `Graph`s (forward and backward) that runs the ops' CPU kernels in f64,
//! and a central-finite-difference gradient checker built on it.
#![allow(dead_code)]

use std::collections::HashMap;

use ramus_core::autodiff::differentiate;
use ramus_core::ops::Op;
use ramus_core::{
    DType, Graph, GraphBuilder, NodeKind, OpDef, ParamId, Role, Source, Space, Sym, ValueType,
};
use ramus_cpu::kernels::{self, Arg, ArgData, KernelCtx};

// ---------------------------------------------------------------- PRNG

/// SplitMix64: tiny, deterministic, good enough for test data.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }
    pub fn vec(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f64> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }
    /// Values with `min_abs <= |x| < max_abs` and a random sign (keeps away
    /// from kinks and poles at 0).
    pub fn vec_away(&mut self, n: usize, min_abs: f64, max_abs: f64) -> Vec<f64> {
        (0..n)
            .map(|_| {
                let m = self.uniform(min_abs, max_abs);
                if self.next_u64() & 1 == 0 {
                    m
                } else {
                    -m
                }
            })
            .collect()
    }
    /// Indices in [0, bound).
    pub fn idx(&mut self, n: usize, bound: usize) -> Vec<u32> {
        (0..n)
            .map(|_| (self.next_u64() % bound as u64) as u32)
            .collect()
    }
}

// ---------------------------------------------------------------- values

/// A value's data: floats or indices, `rows * width` elements.
#[derive(Clone, Debug, PartialEq)]
pub enum Val {
    F(Vec<f64>),
    I(Vec<u32>),
}

impl Val {
    pub fn f(&self) -> &[f64] {
        match self {
            Val::F(v) => v,
            Val::I(_) => panic!("expected a float value, got indices"),
        }
    }
    pub fn i(&self) -> &[u32] {
        match self {
            Val::I(v) => v,
            Val::F(_) => panic!("expected an index value, got floats"),
        }
    }
    pub fn len(&self) -> usize {
        match self {
            Val::F(v) => v.len(),
            Val::I(v) => v.len(),
        }
    }
    fn arg_data(&self) -> ArgData<'_, f64> {
        match self {
            Val::F(v) => ArgData::Float(v),
            Val::I(v) => ArgData::Index(v),
        }
    }
}

/// Row counts of one run: `vertex_rows` vertex rows and one edge row per
/// entry of `edge_parent` (the vertex row that edge belongs to).
#[derive(Clone, Debug, Default)]
pub struct Topo {
    pub vertex_rows: usize,
    pub edge_parent: Vec<u32>,
}

impl Topo {
    /// `n` vertices and no edges.
    pub fn vertices(n: usize) -> Topo {
        Topo {
            vertex_rows: n,
            edge_parent: vec![],
        }
    }
    /// Vertex `v` has `children[v]` child edges; edges are grouped by parent.
    pub fn from_children(children: &[usize]) -> Topo {
        let mut edge_parent = Vec::new();
        for (v, &c) in children.iter().enumerate() {
            edge_parent.extend(std::iter::repeat_n(v as u32, c));
        }
        Topo {
            vertex_rows: children.len(),
            edge_parent,
        }
    }
    pub fn edges(&self) -> usize {
        self.edge_parent.len()
    }
    /// Rows a value of `space` has in this run (1 for static values).
    pub fn rows(&self, space: Space) -> usize {
        match space {
            Space::Vertex => self.vertex_rows,
            Space::Edge => self.edge_parent.len(),
            Space::Static => 1,
        }
    }
    /// Elements a value of type `ty` has in this run.
    pub fn len(&self, ty: &ValueType) -> usize {
        self.rows(ty.space) * ty.width()
    }
}

// ---------------------------------------------------------------- kernels

/// Runs `op`'s f64 kernel on `args` (declared type and data each). The
/// output type comes from `op.infer`; the output buffer is pre-filled with
/// NaN so that elements a kernel forgets to write are caught.
pub fn run_op(
    op: &(impl OpDef + Clone + Into<Op>),
    args: &[(ValueType, Val)],
    topo: &Topo,
) -> Result<(ValueType, Vec<f64>), String> {
    let tys: Vec<&ValueType> = args.iter().map(|(t, _)| t).collect();
    let out_ty = op.infer(&tys)?;
    for (i, (t, v)) in args.iter().enumerate() {
        assert_eq!(
            v.len(),
            topo.len(t),
            "test bug: argument {i} of {} has {} elements, type {t} needs {}",
            op.name(),
            v.len(),
            topo.len(t)
        );
    }
    let kargs: Vec<Arg<'_, f64>> = args
        .iter()
        .map(|(t, v)| Arg {
            ty: t,
            rows: topo.rows(t.space),
            data: v.arg_data(),
        })
        .collect();
    let mut out = vec![f64::NAN; topo.len(&out_ty)];
    let mut ctx = KernelCtx {
        args: &kargs,
        out: &mut out,
        out_rows: topo.rows(out_ty.space),
        vertex_rows: topo.vertex_rows,
        edge_parent: &topo.edge_parent,
        packed_b: None,
        norm_sum: None,
    };
    kernels::run::<f64>(&op.clone().into(), &mut ctx).map_err(|e| e.to_string())?;
    Ok((out_ty, out))
}

/// Same as [`run_op`] in f32 (inputs rounded to f32, output widened back).
pub fn run_op_f32(
    op: &(impl OpDef + Clone + Into<Op>),
    args: &[(ValueType, Val)],
    topo: &Topo,
) -> Result<Vec<f64>, String> {
    let tys: Vec<&ValueType> = args.iter().map(|(t, _)| t).collect();
    let out_ty = op.infer(&tys)?;
    let floats: Vec<Vec<f32>> = args
        .iter()
        .map(|(_, v)| match v {
            Val::F(x) => x.iter().map(|&x| x as f32).collect(),
            Val::I(_) => vec![],
        })
        .collect();
    let kargs: Vec<Arg<'_, f32>> = args
        .iter()
        .zip(&floats)
        .map(|((t, v), f)| Arg {
            ty: t,
            rows: topo.rows(t.space),
            data: match v {
                Val::F(_) => ArgData::Float(f),
                Val::I(i) => ArgData::Index(i),
            },
        })
        .collect();
    let mut out = vec![f32::NAN; topo.len(&out_ty)];
    let mut ctx = KernelCtx {
        args: &kargs,
        out: &mut out,
        out_rows: topo.rows(out_ty.space),
        vertex_rows: topo.vertex_rows,
        edge_parent: &topo.edge_parent,
        packed_b: None,
        norm_sum: None,
    };
    kernels::run::<f32>(&op.clone().into(), &mut ctx).map_err(|e| e.to_string())?;
    Ok(out.into_iter().map(f64::from).collect())
}

// ---------------------------------------------------------------- interpreter

/// Everything a graph reads: row topology, engine inputs and parameters.
#[derive(Clone, Debug, Default)]
pub struct Env {
    pub topo: Topo,
    pub inputs: HashMap<Source, Val>,
    pub params: Vec<Vec<f64>>,
}

/// Evaluates `g` node by node. In a backward graph `Forward(n)` reads node
/// `n` of `fwd` and `OutputGrad(i)` reads `out_grads[i]`.
pub fn eval(
    g: &Graph,
    env: &Env,
    fwd: Option<&[Val]>,
    out_grads: &HashMap<usize, Vec<f64>>,
) -> Result<Vec<Val>, String> {
    let topo = &env.topo;
    let mut vals: Vec<Val> = Vec::with_capacity(g.nodes.len());
    for (n, node) in g.nodes.iter().enumerate() {
        let v = match &node.kind {
            NodeKind::Input(Source::Forward(m)) => fwd
                .ok_or("Forward input outside a backward graph")?
                .get(*m)
                .ok_or("Forward index out of range")?
                .clone(),
            NodeKind::Input(Source::OutputGrad(i)) => Val::F(
                out_grads
                    .get(i)
                    .cloned()
                    .ok_or_else(|| format!("no gradient seed for output {i}"))?,
            ),
            NodeKind::Input(s) => env
                .inputs
                .get(s)
                .cloned()
                .ok_or_else(|| format!("no data for input {s:?}"))?,
            NodeKind::Param(p) => Val::F(
                env.params
                    .get(*p)
                    .cloned()
                    .ok_or_else(|| format!("no data for param {p}"))?,
            ),
            NodeKind::Op(op) => {
                let args: Vec<Arg<'_, f64>> = node
                    .inputs
                    .iter()
                    .map(|&i| {
                        let ty = &g.nodes[i].ty;
                        Arg {
                            ty,
                            rows: topo.rows(ty.space),
                            data: vals[i].arg_data(),
                        }
                    })
                    .collect();
                let mut out = vec![f64::NAN; topo.len(&node.ty)];
                let mut ctx = KernelCtx {
                    args: &args,
                    out: &mut out,
                    out_rows: topo.rows(node.ty.space),
                    vertex_rows: topo.vertex_rows,
                    edge_parent: &topo.edge_parent,
                    packed_b: None,
                    norm_sum: None,
                };
                kernels::run::<f64>(op, &mut ctx)
                    .map_err(|e| format!("node %{n} ({}): {e}", op.signature()))?;
                Val::F(out)
            }
        };
        let want = topo.len(&node.ty);
        let dtype_ok = matches!(
            (&v, node.ty.dtype),
            (Val::F(_), DType::Float) | (Val::I(_), DType::Index)
        );
        if v.len() != want || !dtype_ok {
            return Err(format!(
                "node %{n} ({}) holds {} elements, its type {} needs {want}",
                node.describe(&[]),
                v.len(),
                node.ty
            ));
        }
        vals.push(v);
    }
    Ok(vals)
}

// ---------------------------------------------------------------- gradient check

/// What a gradient is taken with respect to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Slot {
    Input(Source),
    Param(ParamId),
}

/// Analytic (autodiff + kernels) and numeric (central differences)
/// gradients for every float leaf of a checked graph.
pub struct GradReport {
    pub slots: Vec<(Slot, Vec<f64>, Vec<f64>)>,
    pub backward: Graph,
}

impl GradReport {
    pub fn get(&self, slot: Slot) -> (&[f64], &[f64]) {
        let (_, a, n) = self
            .slots
            .iter()
            .find(|(s, ..)| *s == slot)
            .unwrap_or_else(|| panic!("no slot {slot:?}"));
        (a, n)
    }
    /// The gradient is not trivially zero (so agreeing with FD means something).
    pub fn assert_nonzero(&self, slot: Slot) {
        let (_, n) = self.get(slot);
        assert!(
            n.iter().any(|x| x.abs() > 1e-3),
            "gradient of {slot:?} is (numerically) zero: {n:?}"
        );
    }
    pub fn assert_zero(&self, slot: Slot) {
        let (a, n) = self.get(slot);
        assert!(
            a.iter().chain(n).all(|x| *x == 0.0 || x.abs() < 1e-9),
            "gradient of {slot:?} should be zero: {a:?} / {n:?}"
        );
    }
    /// Every checked slot except `except` has a non-trivial gradient.
    pub fn assert_all_nonzero_except(&self, except: &[Slot]) {
        for (s, ..) in &self.slots {
            if !except.contains(s) {
                self.assert_nonzero(*s);
            }
        }
    }
}

/// Seeded roles of `graph` (those autodiff starts from) with their seeds:
/// 1.0 for a scalar loss, random cotangents otherwise.
fn seeds(graph: &Graph, fwd: &[Val], rng: &mut Rng) -> HashMap<usize, Vec<f64>> {
    let mut out = HashMap::new();
    for (i, o) in graph.outputs.iter().enumerate() {
        if matches!(o.role, Role::Scatter | Role::Push | Role::Loss) {
            let n = fwd[o.node].len();
            let s = if o.role == Role::Loss && graph.nodes[o.node].ty == ValueType::fixed(&[1]) {
                vec![1.0]
            } else {
                rng.vec(n, -1.0, 1.0)
            };
            out.insert(i, s);
        }
    }
    out
}

/// `sum_i <seed_i, output_i>` for the forward graph on `env`.
fn objective(graph: &Graph, env: &Env, seeds: &HashMap<usize, Vec<f64>>) -> f64 {
    let vals = eval(graph, env, None, &HashMap::new())
        .unwrap_or_else(|e| panic!("forward evaluation failed: {e}"));
    seeds
        .iter()
        .map(|(&i, s)| {
            vals[graph.outputs[i].node]
                .f()
                .iter()
                .zip(s)
                .map(|(y, s)| y * s)
                .sum::<f64>()
        })
        .sum()
}

fn slot_mut(env: &mut Env, slot: Slot, k: usize) -> &mut f64 {
    match slot {
        Slot::Param(p) => &mut env.params[p][k],
        Slot::Input(s) => match env.inputs.get_mut(&s) {
            Some(Val::F(v)) => &mut v[k],
            _ => unreachable!("only float inputs are slots"),
        },
    }
}

pub const FD_EPS: f64 = 1e-6;
pub const RTOL: f64 = 1e-6;
pub const ATOL: f64 = 1e-8;

/// Differentiates `graph` with the real autodiff, evaluates both graphs with
/// the interpreter, and compares every gradient output with central finite
/// differences of `sum <seed, output>` (seed 1.0 for a scalar loss, a
/// random cotangent for any other seeded output). Panics on any mismatch.
pub fn grad_check(graph: &Graph, param_shapes: &[Vec<usize>], env: &Env, seed: u64) -> GradReport {
    let bwd = differentiate(graph, param_shapes, "test")
        .unwrap_or_else(|e| panic!("differentiate failed: {e}"));
    grad_check_backward(graph, param_shapes, env, seed, bwd)
}

/// [`grad_check`] with the backward graph given: compares the gradients
/// `bwd` computes for `graph` with finite differences of `graph`.
pub fn grad_check_backward(
    graph: &Graph,
    param_shapes: &[Vec<usize>],
    env: &Env,
    seed: u64,
    bwd: Graph,
) -> GradReport {
    let mut rng = Rng::new(seed);
    let fwd = eval(graph, env, None, &HashMap::new())
        .unwrap_or_else(|e| panic!("forward evaluation failed: {e}"));
    let seeds = seeds(graph, &fwd, &mut rng);
    assert!(!seeds.is_empty(), "test bug: graph has no seeded output");
    let bvals = eval(&bwd, env, Some(&fwd), &seeds)
        .unwrap_or_else(|e| panic!("backward evaluation failed: {e}\n{}", bwd.listing(&[])));

    // analytic gradients, zero where autodiff emits nothing
    let mut slots: Vec<Slot> = Vec::new();
    let mut analytic: HashMap<Slot, Vec<f64>> = HashMap::new();
    let mut inputs: Vec<_> = env
        .inputs
        .iter()
        .filter(|(_, v)| matches!(v, Val::F(_)))
        .collect();
    inputs.sort_by_key(|(s, _)| format!("{s:?}"));
    for (s, v) in inputs {
        slots.push(Slot::Input(*s));
        analytic.insert(Slot::Input(*s), vec![0.0; v.len()]);
    }
    for (p, v) in env.params.iter().enumerate() {
        slots.push(Slot::Param(p));
        analytic.insert(Slot::Param(p), vec![0.0; v.len()]);
    }
    for o in &bwd.outputs {
        let values = bvals[o.node].f();
        let slot = match o.role {
            Role::ParamGrad(p) | Role::ParamRowGrad(p) => Slot::Param(p),
            Role::PullGrad => Slot::Input(Source::Pull),
            Role::ChildGradAll => Slot::Input(Source::GatherAll),
            Role::ChildGrad(k) => Slot::Input(Source::Gather(k)),
            Role::HeadInputGrad => Slot::Input(Source::HeadInput),
            r => panic!("unexpected output role {r:?} in a backward graph"),
        };
        let acc = analytic
            .get_mut(&slot)
            .unwrap_or_else(|| panic!("gradient output {:?} for a leaf with no data", o.role));
        if let Role::ParamRowGrad(p) = o.role {
            let idx = bvals[o.aux.expect("ParamRowGrad without an index node")].i();
            let width: usize = param_shapes[p][1..].iter().product();
            assert_eq!(
                values.len(),
                idx.len() * width,
                "row gradient of param {p}: {} values for {} indices",
                values.len(),
                idx.len()
            );
            for (r, &i) in idx.iter().enumerate() {
                for j in 0..width {
                    acc[i as usize * width + j] += values[r * width + j];
                }
            }
        } else {
            assert_eq!(
                values.len(),
                acc.len(),
                "gradient output {:?} has the wrong size",
                o.role
            );
            for (a, v) in acc.iter_mut().zip(values) {
                *a += v;
            }
        }
    }

    // numeric gradients
    let mut env = env.clone();
    let mut report = Vec::new();
    for slot in slots {
        let n = analytic[&slot].len();
        let mut numeric = vec![0.0; n];
        for (k, num) in numeric.iter_mut().enumerate() {
            let x0 = *slot_mut(&mut env, slot, k);
            *slot_mut(&mut env, slot, k) = x0 + FD_EPS;
            let up = objective(graph, &env, &seeds);
            *slot_mut(&mut env, slot, k) = x0 - FD_EPS;
            let down = objective(graph, &env, &seeds);
            *slot_mut(&mut env, slot, k) = x0;
            *num = (up - down) / (2.0 * FD_EPS);
        }
        let a = &analytic[&slot];
        for k in 0..n {
            let (x, y) = (a[k], numeric[k]);
            let tol = RTOL * x.abs().max(y.abs()) + ATOL;
            assert!(
                (x - y).abs() <= tol,
                "gradient mismatch for {slot:?}[{k}]: autodiff {x:.12e}, finite differences {y:.12e}\nanalytic {a:?}\nnumeric  {numeric:?}\nbackward graph:\n{}",
                bwd.listing(&[])
            );
        }
        report.push((slot, a.clone(), numeric));
    }
    GradReport {
        slots: report,
        backward: bwd,
    }
}

// ---------------------------------------------------------------- building cases

/// A forward graph under construction together with the data it will run on.
pub struct Case {
    pub b: GraphBuilder,
    pub env: Env,
    pub shapes: Vec<Vec<usize>>,
}

impl Case {
    /// A case over `topo` with parameters given as (shape, data).
    pub fn new(topo: Topo, params: Vec<(Vec<usize>, Vec<f64>)>) -> Case {
        let shapes: Vec<Vec<usize>> = params.iter().map(|(s, _)| s.clone()).collect();
        for (s, d) in &params {
            assert_eq!(
                s.iter().product::<usize>(),
                d.len(),
                "test bug: param data does not match shape {s:?}"
            );
        }
        Case {
            b: GraphBuilder::new("test", &shapes),
            env: Env {
                topo,
                inputs: HashMap::new(),
                params: params.into_iter().map(|(_, d)| d).collect(),
            },
            shapes,
        }
    }
    /// An engine input with data.
    pub fn input(&mut self, s: Source, ty: ValueType, v: Val) -> Sym {
        assert_eq!(
            v.len(),
            self.env.topo.len(&ty),
            "test bug: data for {s:?} does not match {ty}"
        );
        self.env.inputs.insert(s, v);
        self.b.input(s, ty)
    }
    /// A float input with uniform random data in [lo, hi).
    pub fn input_rand(&mut self, s: Source, ty: ValueType, rng: &mut Rng, lo: f64, hi: f64) -> Sym {
        let n = self.env.topo.len(&ty);
        self.input(s, ty, Val::F(rng.vec(n, lo, hi)))
    }
    pub fn param(&mut self, p: ParamId) -> Sym {
        self.b.param(p)
    }
    /// Finishes the graph with `y` as its (seeded) loss output.
    pub fn finish(mut self, y: Sym) -> (Graph, Vec<Vec<usize>>, Env) {
        self.b.output(Role::Loss, y, None);
        let g = self
            .b
            .finish()
            .unwrap_or_else(|e| panic!("building the test graph failed: {e}"));
        (g, self.shapes, self.env)
    }
    /// Finishes with `y` as the loss and runs [`grad_check`].
    pub fn check(self, y: Sym, seed: u64) -> GradReport {
        let (g, shapes, env) = self.finish(y);
        grad_check(&g, &shapes, &env, seed)
    }
}

/// Convenience: a primitive op type as an [`Op`].
pub fn prim(op: impl Into<Op>) -> Op {
    op.into()
}

// ---------------------------------------------------------------- comparisons

/// Asserts `got` matches `want` elementwise within `tol * (1 + |want|)`.
#[track_caller]
pub fn assert_close(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(
        got.len(),
        want.len(),
        "{what}: length {} vs expected {}",
        got.len(),
        want.len()
    );
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}: element {i}: got {g}, expected {w}\ngot  {got:?}\nwant {want:?}"
        );
    }
}
