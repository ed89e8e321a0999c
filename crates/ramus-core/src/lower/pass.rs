//! The entry points: [`lower`] one graph, [`lower_model`] a model's cells.

use crate::error::{CoreError, Result};
use crate::graph::{Graph, NodeId};
use crate::ops::Op;

use super::lowering::Lowering;
use super::types::{unsupported, CellProgram, VecExpr};

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Lowers the nodes `outputs` of inference graph `g` (a vertex function's
/// forward graph, or a head's) to a cell program; see the module docs.
pub fn lower(g: &Graph, outputs: &[NodeId]) -> Result<CellProgram> {
    let n = g.nodes.len();
    let mut needed = vec![false; n];
    for &o in outputs {
        if o >= n {
            return Err(CoreError::Shape {
                context: "compiled-engine lowering".into(),
                op: "outputs".into(),
                message: format!("output node %{o} does not exist (the graph has {n} nodes)"),
            });
        }
        needed[o] = true;
    }
    for i in (0..n).rev() {
        if needed[i] {
            for &x in &g.nodes[i].inputs {
                needed[x] = true;
            }
        }
    }
    let unit_class = classify(g, &needed);
    let units = unit_count(g, &needed, &unit_class, outputs)?;
    Lowering::run(g, units, &needed, &unit_class, outputs)
}

/// A model's cells for a compiled engine: the function run on leaves, the
/// one run on internal vertices (the same for a single-function model),
/// and the head.
#[derive(Clone, Debug)]
pub struct ModelCells {
    /// Function index and cell (outputs: scattered state, pushed value).
    pub leaf: (usize, CellProgram),
    pub internal: (usize, CellProgram),
    /// The head's scores.
    pub head: CellProgram,
    /// Rows of the embedding table the cells read, if they read a token.
    pub vocab: Option<usize>,
}

/// Lowers `model` for a compiled engine: its leaf and internal vertex
/// functions (each must scatter a state and push a value) and its head's
/// scores.
pub fn lower_model(model: &crate::Model) -> Result<ModelCells> {
    let err = |message: String| CoreError::Shape {
        context: "compiled-engine lowering".into(),
        op: model.name.clone(),
        message,
    };
    let (leaf, internal) = match model.selector {
        crate::FunctionSelector::LeafInternal { leaf, internal } => (leaf, internal),
        crate::FunctionSelector::Single(f) => (f, f),
        crate::FunctionSelector::ByKind(_) => {
            return Err(err(
                "the compiled engines run one leaf and one internal function; this model \
                 selects its functions by vertex kind (use the batched engine)"
                    .into(),
            ))
        }
    };
    let cell = |f: usize| -> Result<(usize, CellProgram)> {
        let func = model.functions.get(f).ok_or_else(|| {
            err(format!(
                "the selector names function {f}, which does not exist"
            ))
        })?;
        let (Some(scatter), Some(push)) = (func.scatter, func.push) else {
            return Err(err(format!(
                "function `{}` must scatter a state and push a value to be compiled",
                func.name
            )));
        };
        Ok((f, lower(&func.forward, &[scatter, push])?))
    };
    let (leaf, internal) = (cell(leaf)?, cell(internal)?);
    let logits = model
        .head
        .logits
        .ok_or_else(|| err("the head computes no scores".into()))?;
    let head = lower(&model.head.forward, &[logits])?;
    let vocab = embedding_rows(model, &[&leaf.1, &internal.1]);
    Ok(ModelCells {
        leaf,
        internal,
        head,
        vocab,
    })
}

/// Rows of the first embedding table `programs` look up (in order): the
/// vocabulary size a compiled engine's tables cover.
pub fn embedding_rows(model: &crate::Model, programs: &[&CellProgram]) -> Option<usize> {
    programs.iter().find_map(|program| {
        program.vectors.iter().find_map(|v| match v.expr {
            VecExpr::Embedding { table } => model
                .params
                .get(table)
                .and_then(|p| p.shape.first().copied()),
            _ => None,
        })
    })
}

/// Marks unit values: products and everything computed from one.
fn classify(g: &Graph, needed: &[bool]) -> Vec<bool> {
    let mut unit = vec![false; g.nodes.len()];
    for (i, node) in g.nodes.iter().enumerate() {
        if !needed[i] {
            continue;
        }
        if matches!(node.op(), Some(Op::MatMul(_) | Op::RowMatMul(_))) {
            // (a product of a unit value is a new stage: see `Lowering::staged`)
            unit[i] = true;
        } else {
            unit[i] = node.inputs.iter().any(|&x| unit[x]);
        }
    }
    unit
}

/// The unit count: the gcd of every unit value's width and of the slice
/// and concat boundaries on unit values (of the output widths when no
/// product feeds the outputs).
fn unit_count(g: &Graph, needed: &[bool], unit: &[bool], outputs: &[NodeId]) -> Result<usize> {
    let mut u = 0;
    for (i, node) in g.nodes.iter().enumerate() {
        if !needed[i] || !unit[i] {
            continue;
        }
        u = gcd(u, node.ty.width());
        match node.op() {
            Some(Op::Slice(s)) => u = gcd(gcd(u, s.start), s.len),
            Some(Op::Concat(_)) => {
                for &x in &node.inputs {
                    u = gcd(u, g.nodes[x].ty.width());
                }
            }
            // a static matrix times per-row matrices: the units split the columns
            Some(Op::RowMatMul(rm))
                if node
                    .inputs
                    .first()
                    .is_some_and(|&a| !g.nodes[a].ty.is_rows()) =>
            {
                u = gcd(u, rm.n)
            }
            _ => {}
        }
    }
    if u == 0 {
        // no product: the outputs are vectors, read per unit column
        u = outputs
            .iter()
            .fold(0, |u, &o| gcd(u, g.nodes[o].ty.width()));
    }
    if u == 0 {
        return Err(CoreError::Shape {
            context: "compiled-engine lowering".into(),
            op: "cell".into(),
            message: format!("the outputs {outputs:?} have no columns"),
        });
    }
    for &o in outputs {
        if !g.nodes[o].ty.width().is_multiple_of(u) {
            return Err(unsupported(
                g,
                o,
                format!("output width is not a multiple of the {u} units"),
            ));
        }
    }
    Ok(u)
}
