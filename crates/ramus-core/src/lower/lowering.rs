//! The lowering of one graph node at a time (the [`Lowering`] state).

use std::collections::HashMap;

use crate::error::{CoreError, Result};
use crate::graph::{DType, Graph, NodeId, NodeKind, ParamId, Source, Space};
use crate::ops::{MatMul, Op, RowMatMul};

use super::types::{
    scalar_deps, scalar_vectors, unsupported, vec_deps, CellProgram, ChildRef, ScalarExpr,
    ScalarId, ScalarNode, Scope, VecExpr, VecId, VecNode,
};

fn space_scope(space: Space) -> Scope {
    if space == Space::Edge {
        Scope::Edge
    } else {
        Scope::Vertex
    }
}

/// What a graph node lowers to.
#[derive(Clone, Debug)]
enum Lowered {
    /// A vector.
    Vector(VecId),
    /// A static parameter (read per column where used).
    Param(ParamId),
    /// An index row (the token).
    Token,
    /// A unit value: one scalar per lane.
    Unit(Vec<ScalarId>),
}

pub(super) struct Lowering<'g> {
    g: &'g Graph,
    units: usize,
    vectors: Vec<VecNode>,
    scalars: Vec<ScalarNode>,
    values: Vec<Option<Lowered>>,
    one: Option<VecId>,
    reads: HashMap<(VecId, usize), ScalarId>,
    params: HashMap<(ParamId, usize), ScalarId>,
    /// The scratch vector of each unit value a product reads.
    staged: HashMap<NodeId, VecId>,
    /// Scalars re-read or carried into a later stage (see `at_stage`).
    carried: HashMap<(ScalarId, usize), ScalarId>,
    stores: Vec<Vec<(ScalarId, usize)>>,
    scratch_width: usize,
}

impl Lowering<'_> {
    /// Lowers the `needed` nodes of `g` (unit values where `unit_class`
    /// says so) with `units` units, then reads `outputs` as lanes.
    pub(super) fn run(
        g: &Graph,
        units: usize,
        needed: &[bool],
        unit_class: &[bool],
        outputs: &[NodeId],
    ) -> Result<CellProgram> {
        let n = g.nodes.len();
        let mut l = Lowering {
            g,
            units,
            vectors: Vec::new(),
            scalars: Vec::new(),
            values: vec![None; n],
            one: None,
            reads: HashMap::new(),
            params: HashMap::new(),
            staged: HashMap::new(),
            carried: HashMap::new(),
            stores: Vec::new(),
            scratch_width: 0,
        };
        for i in (0..n).filter(|&i| needed[i]) {
            let value = l.lower_node(i, unit_class[i])?;
            l.values[i] = Some(value);
        }
        let mut lanes = Vec::with_capacity(outputs.len());
        for &o in outputs {
            lanes.push(l.lanes(o)?);
        }
        let stages = 1 + l.scalars.iter().map(|s| s.stage).max().unwrap_or(0);
        let mut stores = l.stores;
        stores.resize(stages, Vec::new());
        Ok(CellProgram {
            units,
            vectors: l.vectors,
            scalars: l.scalars,
            outputs: lanes,
            stages,
            stores,
            scratch_width: l.scratch_width,
        })
    }

    fn value(&self, x: NodeId) -> Result<&Lowered> {
        self.values[x]
            .as_ref()
            .ok_or_else(|| unsupported(self.g, x, "used before it was lowered"))
    }

    fn vec(&mut self, expr: VecExpr, width: usize, scope: Scope) -> VecId {
        let stage = vec_deps(&expr)
            .into_iter()
            .map(|d| self.vectors[d].stage)
            .max()
            .unwrap_or(0);
        self.vectors.push(VecNode {
            expr,
            width,
            scope,
            stage,
        });
        self.vectors.len() - 1
    }

    fn scalar(&mut self, expr: ScalarExpr, scope: Scope) -> ScalarId {
        let stage = match &expr {
            e @ (ScalarExpr::Dot { .. }
            | ScalarExpr::RowDot { .. }
            | ScalarExpr::ColumnDot { .. }
            | ScalarExpr::Read { .. }) => scalar_vectors(e)
                .into_iter()
                .map(|v| self.vectors[v].stage)
                .max()
                .unwrap_or(0),
            other => scalar_deps(other)
                .into_iter()
                .map(|d| self.scalars[d].stage)
                .max()
                .unwrap_or(0),
        };
        self.scalars.push(ScalarNode { expr, scope, stage });
        self.scalars.len() - 1
    }

    /// Scalar `x` for use in (later) stage `stage`: itself in its own stage;
    /// a read (of a parameter or a vector) re-read there; anything else
    /// stored to the scratch row by its stage and read back.
    fn at_stage(&mut self, x: ScalarId, stage: usize) -> Result<ScalarId> {
        let node = &self.scalars[x];
        if node.stage == stage {
            return Ok(x);
        }
        if let Some(&c) = self.carried.get(&(x, stage)) {
            return Ok(c);
        }
        let copy = match node.expr {
            ScalarExpr::Param { .. } | ScalarExpr::Read { .. } => node.expr.clone(),
            _ => {
                if node.scope != Scope::Vertex {
                    return Err(CoreError::Shape {
                        context: "compiled-engine lowering".into(),
                        op: "cell".into(),
                        message: "a per-edge value read by a later stage is not supported".into(),
                    });
                }
                let from = node.stage;
                let slot = self.scratch_width;
                self.scratch_width += self.units;
                if self.stores.len() <= from {
                    self.stores.resize(from + 1, Vec::new());
                }
                self.stores[from].push((x, slot));
                self.vectors.push(VecNode {
                    expr: VecExpr::Staged { slot },
                    width: self.units,
                    scope: Scope::Vertex,
                    stage: from + 1,
                });
                ScalarExpr::Read {
                    src: self.vectors.len() - 1,
                    col: 0,
                }
            }
        };
        let scope = self.scalars[x].scope;
        self.scalars.push(ScalarNode {
            expr: copy,
            scope,
            stage,
        });
        let c = self.scalars.len() - 1;
        self.carried.insert((x, stage), c);
        Ok(c)
    }

    /// The scratch vector holding unit value `x` (stored by its stage, read
    /// from the next).
    fn staged(&mut self, x: NodeId) -> Result<VecId> {
        if let Some(&v) = self.staged.get(&x) {
            return Ok(v);
        }
        if self.g.nodes[x].ty.space != Space::Vertex {
            return Err(unsupported(
                self.g,
                x,
                "a product of per-edge unit values is not supported",
            ));
        }
        let lanes = self.lanes(x)?;
        let stage = lanes
            .iter()
            .map(|&l| self.scalars[l].stage)
            .max()
            .unwrap_or(0);
        let slot = self.scratch_width;
        if self.stores.len() <= stage {
            self.stores.resize(stage + 1, Vec::new());
        }
        for (m, &l) in lanes.iter().enumerate() {
            self.stores[stage].push((l, slot + m * self.units));
        }
        let width = lanes.len() * self.units;
        self.scratch_width += width;
        self.vectors.push(VecNode {
            expr: VecExpr::Staged { slot },
            width,
            scope: Scope::Vertex,
            stage: stage + 1,
        });
        let v = self.vectors.len() - 1;
        self.staged.insert(x, v);
        Ok(v)
    }

    fn vector_of(&self, x: NodeId) -> Result<VecId> {
        match self.value(x)? {
            Lowered::Vector(v) => Ok(*v),
            _ => Err(unsupported(self.g, x, "expected a vector value here")),
        }
    }

    /// Node `x`'s lanes: its scalars, or reads of a vector / parameter.
    fn lanes(&mut self, x: NodeId) -> Result<Vec<ScalarId>> {
        let width = self.g.nodes[x].ty.width();
        if !width.is_multiple_of(self.units) {
            return Err(unsupported(
                self.g,
                x,
                format!(
                    "width {width} is not a multiple of the {} units",
                    self.units
                ),
            ));
        }
        let lanes = width / self.units;
        match self.value(x)?.clone() {
            Lowered::Unit(s) => Ok(s),
            Lowered::Vector(v) => Ok((0..lanes).map(|m| self.read(v, m * self.units)).collect()),
            Lowered::Param(p) => {
                if self.g.nodes[x].ty.shape.len() != 1 {
                    return Err(unsupported(
                        self.g,
                        x,
                        "only a parameter row (a bias) is read per unit",
                    ));
                }
                Ok((0..lanes)
                    .map(|m| self.param_read(p, m * self.units))
                    .collect())
            }
            Lowered::Token => Err(unsupported(self.g, x, "a token is not a float value")),
        }
    }

    fn read(&mut self, src: VecId, col: usize) -> ScalarId {
        if let Some(&s) = self.reads.get(&(src, col)) {
            return s;
        }
        let scope = self.vectors[src].scope;
        let s = self.scalar(ScalarExpr::Read { src, col }, scope);
        self.reads.insert((src, col), s);
        s
    }

    fn param_read(&mut self, param: ParamId, col: usize) -> ScalarId {
        if let Some(&s) = self.params.get(&(param, col)) {
            return s;
        }
        let s = self.scalar(ScalarExpr::Param { param, col }, Scope::Vertex);
        self.params.insert((param, col), s);
        s
    }

    fn is_one(&self, x: NodeId) -> bool {
        matches!(self.values[x], Some(Lowered::Vector(v)) if Some(v) == self.one)
    }

    fn lower_node(&mut self, i: NodeId, unit: bool) -> Result<Lowered> {
        let g = self.g;
        let node = &g.nodes[i];
        let op = match &node.kind {
            NodeKind::Param(p) => return Ok(Lowered::Param(*p)),
            NodeKind::Input(source) => return self.lower_input(i, *source),
            NodeKind::Op(op) => op.clone(),
        };
        if node.ty.dtype != DType::Float {
            return Err(unsupported(g, i, "only float values are lowered"));
        }
        let args = &node.inputs;
        // multiplying by an inference dropout mask (1) is the identity
        if matches!(op, Op::Mul(_)) {
            if let [a, b] = args[..] {
                let keep = if self.is_one(b) {
                    Some(a)
                } else if self.is_one(a) {
                    Some(b)
                } else {
                    None
                };
                if let Some(x) = keep {
                    return Ok(self.value(x)?.clone());
                }
            }
        }
        if unit {
            return self.lower_unit(i, op);
        }
        self.lower_vector_op(i, op)
    }

    /// An input node: a child's state, the head input, the token, or a
    /// dropout mask (1 at inference).
    fn lower_input(&mut self, i: NodeId, source: Source) -> Result<Lowered> {
        let g = self.g;
        let node = &g.nodes[i];
        let scope = space_scope(node.ty.space);
        let width = node.ty.width();
        let expr = match source {
            Source::Gather(k) => VecExpr::ChildState(ChildRef::Index(k)),
            Source::GatherAll => VecExpr::ChildState(ChildRef::Edge),
            Source::HeadInput => VecExpr::HeadInput,
            Source::Token => return Ok(Lowered::Token),
            Source::DropoutMask { .. } => {
                let one = self.vec(VecExpr::One, width, scope);
                self.one = Some(one);
                return Ok(Lowered::Vector(one));
            }
            _ => {
                return Err(unsupported(
                    g,
                    i,
                    "this input is not available to the compiled engine",
                ))
            }
        };
        Ok(Lowered::Vector(self.vec(expr, width, scope)))
    }

    /// A float op node that is not a unit value: a vector, column by column.
    fn lower_vector_op(&mut self, i: NodeId, op: Op) -> Result<Lowered> {
        let g = self.g;
        let node = &g.nodes[i];
        let scope = space_scope(node.ty.space);
        let width = node.ty.width();
        let args = &node.inputs;
        let expr = match &op {
            Op::Embedding(_) => VecExpr::Embedding {
                table: self.embedding_table(i)?,
            },
            Op::EmbeddingUnk(_) => VecExpr::EmbeddingUnk {
                table: self.embedding_table(i)?,
                rows: g.nodes[args[0]].ty.shape[0],
            },
            Op::Slice(s) => VecExpr::Slice {
                src: self.vector_of(args[0])?,
                offset: s.start,
            },
            Op::Concat(_) => {
                let parts = args
                    .iter()
                    .map(|&x| Ok((self.vector_of(x)?, g.nodes[x].ty.width())))
                    .collect::<Result<_>>()?;
                VecExpr::Concat { parts }
            }
            Op::SumChildren(_) => VecExpr::SumChildren(self.vector_of(args[0])?),
            Op::ExpandChildren(_) => VecExpr::Parent(self.vector_of(args[0])?),
            crate::elementwise_op!() => {
                let mut vs = Vec::with_capacity(args.len());
                for &x in args {
                    vs.push(match self.value(x)?.clone() {
                        Lowered::Vector(v) => v,
                        Lowered::Param(p) => {
                            let w = g.nodes[x].ty.width();
                            self.vec(VecExpr::Param(p), w, Scope::Vertex)
                        }
                        _ => return Err(unsupported(g, i, "an operand is not a float vector")),
                    });
                }
                VecExpr::Map {
                    op,
                    node: i,
                    args: vs,
                }
            }
            // products are unit values (`classify`), lowered by `lower_unit`
            Op::MatMul(_)
            | Op::RowMatMul(_)
            | Op::Pad(_)
            | Op::SumRows(_)
            | Op::BroadcastRows(_)
            | Op::Reshape(_)
            | Op::EmbeddingUnkBackward(_)
            | Op::SoftmaxXent(_)
            | Op::SoftmaxXentBackward(_)
            | crate::image_op!() => {
                return Err(unsupported(
                    g,
                    i,
                    "this op has no per-column form for the compiled engine",
                ))
            }
        };
        Ok(Lowered::Vector(self.vec(expr, width, scope)))
    }

    /// The parameter table embedding node `i` looks up by the vertex token.
    fn embedding_table(&mut self, i: NodeId) -> Result<ParamId> {
        let g = self.g;
        let args = &g.nodes[i].inputs;
        match (self.value(args[0])?, self.value(args[1])?) {
            (Lowered::Param(p), Lowered::Token) => Ok(*p),
            _ => Err(unsupported(
                g,
                i,
                "an embedding must look a parameter table up by the vertex token",
            )),
        }
    }

    /// Per-row operand `x` of a product as a vector (a unit value is
    /// stored by its stage and read back by the next).
    fn product_input(&mut self, x: NodeId) -> Result<VecId> {
        match self.value(x)? {
            Lowered::Unit(_) => self.staged(x),
            _ => self.vector_of(x),
        }
    }

    /// A per-row matrix product (see the module docs): a per-row matrix
    /// times a per-row vector, or a static matrix times a per-row matrix.
    fn lower_row_matmul(&mut self, i: NodeId, rm: &RowMatMul) -> Result<Lowered> {
        let g = self.g;
        let node = &g.nodes[i];
        let (a, b) = (node.inputs[0], node.inputs[1]);
        let scope = space_scope(node.ty.space);
        let u = self.units;
        let lanes = node.ty.width() / u;
        if rm.trans_b {
            return Err(unsupported(
                g,
                i,
                "a per-row product with a transposed right operand is not lowered",
            ));
        }
        if let Lowered::Param(weight) = *self.value(a)? {
            if !rm.n.is_multiple_of(u) {
                return Err(unsupported(
                    g,
                    i,
                    format!("{} columns do not split over the {u} units", rm.n),
                ));
            }
            let input = self.product_input(b)?;
            let dots = (0..lanes)
                .map(|l| {
                    let (row, col) = ((l * u) / rm.n, (l * u) % rm.n);
                    let (base, step) = if rm.trans_a {
                        (row, rm.m)
                    } else {
                        (row * rm.k, 1)
                    };
                    self.scalar(
                        ScalarExpr::ColumnDot {
                            weight,
                            base,
                            step,
                            input,
                            offset: col,
                            stride: rm.n,
                            k: rm.k,
                        },
                        scope,
                    )
                })
                .collect();
            return Ok(Lowered::Unit(dots));
        }
        if rm.n != 1 || rm.trans_a || matches!(self.value(b)?, Lowered::Param(_)) {
            return Err(unsupported(
                g,
                i,
                "per-row products lower as a static matrix times per-row matrices or a \
                 per-row matrix times a per-row vector (no transposes)",
            ));
        }
        let (matrix, vector) = (self.product_input(a)?, self.product_input(b)?);
        let dots = (0..lanes)
            .map(|l| {
                self.scalar(
                    ScalarExpr::RowDot {
                        matrix,
                        row: l * u,
                        vector,
                        k: rm.k,
                    },
                    scope,
                )
            })
            .collect();
        Ok(Lowered::Unit(dots))
    }

    fn lower_unit(&mut self, i: NodeId, op: Op) -> Result<Lowered> {
        let g = self.g;
        let node = &g.nodes[i];
        let args = &node.inputs;
        let u = self.units;
        let lanes = node.ty.width() / u;
        match &op {
            Op::MatMul(mm) => self.lower_dot(i, mm),
            Op::RowMatMul(rm) => self.lower_row_matmul(i, rm),
            Op::Slice(s) => {
                let src = self.lanes(args[0])?;
                Ok(Lowered::Unit(
                    src[s.start / u..(s.start + s.len) / u].to_vec(),
                ))
            }
            Op::Concat(_) => {
                let mut all = Vec::with_capacity(lanes);
                for &x in args {
                    all.extend(self.lanes(x)?);
                }
                Ok(Lowered::Unit(all))
            }
            Op::SumChildren(_) => {
                let src = self.lanes(args[0])?;
                let sums = src
                    .into_iter()
                    .map(|s| self.scalar(ScalarExpr::ChildSum(s), Scope::Vertex))
                    .collect();
                Ok(Lowered::Unit(sums))
            }
            // an edge reads its vertex's scalars directly
            Op::ExpandChildren(_) => Ok(Lowered::Unit(self.lanes(args[0])?)),
            crate::elementwise_op!() => self.lower_unit_map(i, &op),
            Op::Pad(_)
            | Op::SumRows(_)
            | Op::BroadcastRows(_)
            | Op::Reshape(_)
            | Op::Embedding(_)
            | Op::EmbeddingUnk(_)
            | Op::EmbeddingUnkBackward(_)
            | Op::SoftmaxXent(_)
            | Op::SoftmaxXentBackward(_)
            | crate::image_op!() => Err(unsupported(
                g,
                i,
                "this op has no per-unit form for the compiled engine",
            )),
        }
    }

    /// A unit product `x·Wᵀ` ([`MatMul`] with a `[out, in]` weight): one
    /// dot product per unit lane.
    fn lower_dot(&mut self, i: NodeId, mm: &MatMul) -> Result<Lowered> {
        let g = self.g;
        let node = &g.nodes[i];
        let args = &node.inputs;
        let scope = space_scope(node.ty.space);
        let u = self.units;
        let lanes = node.ty.width() / u;
        let input = self.product_input(args[0])?;
        let weight = match self.value(args[1])? {
            Lowered::Param(p) => *p,
            _ => return Err(unsupported(g, i, "the weight must be a parameter")),
        };
        let wty = &g.nodes[args[1]].ty;
        if mm.trans_a || !mm.trans_b || wty.shape.len() != 2 {
            return Err(unsupported(
                g,
                i,
                "only products x·Wᵀ with a [out, in] weight are lowered",
            ));
        }
        let k = wty.shape[1];
        let dots = (0..lanes)
            .map(|m| {
                self.scalar(
                    ScalarExpr::Dot {
                        weight,
                        row: m * u,
                        input,
                        k,
                    },
                    scope,
                )
            })
            .collect();
        Ok(Lowered::Unit(dots))
    }

    /// An elementwise op on unit values: the op applied lane by lane.
    fn lower_unit_map(&mut self, i: NodeId, op: &Op) -> Result<Lowered> {
        let g = self.g;
        let node = &g.nodes[i];
        let args = &node.inputs;
        let scope = space_scope(node.ty.space);
        let lanes = node.ty.width() / self.units;
        let operands = args
            .iter()
            .map(|&x| self.lanes(x))
            .collect::<Result<Vec<_>>>()?;
        let mut out = Vec::with_capacity(lanes);
        for m in 0..lanes {
            let a = operands
                .iter()
                .map(|lanes| lanes.get(m).copied())
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| unsupported(g, i, "an operand is narrower than the result"))?;
            // every operand of a multi-stage op in its own stage: a stage's
            // code never reads another stage's registers
            let stage = a.iter().map(|&x| self.scalars[x].stage).max().unwrap_or(0);
            let a = a
                .into_iter()
                .map(|x| self.at_stage(x, stage))
                .collect::<Result<Vec<_>>>()?;
            out.push(self.scalar(
                ScalarExpr::Map {
                    op: op.clone(),
                    node: i,
                    args: a,
                },
                scope,
            ));
        }
        Ok(Lowered::Unit(out))
    }
}
