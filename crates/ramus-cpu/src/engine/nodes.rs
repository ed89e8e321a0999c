//! Running a pass's op nodes: where a node's value lives (a backward
//! graph reads its forward graph's arena), op nodes run over a row range or
//! every row and edge of a vertex function, packed weight operands, running
//! statistics after a train-mode pass, and parameter gradients added into
//! the gradients.

use ramus_core::graph::{DType, Graph, NodeId, NodeKind, ParamId, Role, Source, Space};
use ramus_core::ops::{BatchNorm, Op};
use ramus_core::{CoreError, Grads, Params, Real};
use ramus_graph::FunctionRows;

use ramus_exec::{ExecError, Result};

use ramus_exec::Range;

use super::norm_sync;
use crate::kernels::{self, update_running_stats, Arg, ArgData, KernelCtx, NormSum, PackedB};

use super::arena::{Arena, Packs, Span};

/// Edge parents relative to the first row of the run.
pub(super) fn local_edges(buf: &mut Vec<u32>, parents: &[u32], r0: usize) {
    buf.clear();
    buf.extend(parents.iter().map(|&p| p - r0 as u32));
}

/// Nodes that `roots` depend on.
pub(super) fn ancestors(g: &Graph, roots: &[NodeId]) -> Vec<bool> {
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

/// The arena and node whose buffer holds node `n`'s value: a backward
/// graph's `Forward(m)` inputs live in the forward arena as node `m`.
pub(super) fn source<'a, T: Real>(
    g: &Graph,
    n: NodeId,
    own: &'a Arena<T>,
    fwd: Option<&'a Arena<T>>,
) -> Result<(&'a Arena<T>, NodeId)> {
    match g.nodes[n].kind {
        NodeKind::Input(Source::Forward(m)) => {
            let fwd = fwd.ok_or_else(|| {
                ExecError::Input("forward value requested outside a backward graph".into())
            })?;
            Ok((fwd, m))
        }
        _ => Ok((own, n)),
    }
}

/// The float buffer holding node `n`'s value.
pub(super) fn resolve_floats<'a, T: Real>(
    g: &Graph,
    n: NodeId,
    own: &'a Arena<T>,
    fwd: Option<&'a Arena<T>>,
) -> Result<&'a [T]> {
    let (arena, m) = source(g, n, own, fwd)?;
    Ok(&arena.vals[m])
}

/// The index buffer holding node `n`'s value.
pub(super) fn resolve_indices<'a, T: Real>(
    g: &Graph,
    n: NodeId,
    own: &'a Arena<T>,
    fwd: Option<&'a Arena<T>>,
) -> Result<&'a [u32]> {
    let (arena, m) = source(g, n, own, fwd)?;
    Ok(&arena.idx[m])
}

/// Runs the op nodes `nodes` of `g` over every row and edge of a vertex function.
pub(super) fn run_all_rows<T: Real>(
    g: &Graph,
    nodes: &[NodeId],
    own: &mut Arena<T>,
    fwd: Option<&Arena<T>>,
    params: &Params<T>,
    rows: &FunctionRows,
    packs: &mut Packs<T>,
) -> Result<()> {
    run_nodes(
        g,
        nodes,
        own,
        fwd,
        params,
        Span {
            range: Range::all(rows),
            edge_parent: &rows.edge_parent,
        },
        packs,
    )
}

/// Runs the op nodes `nodes` of `g` over `span`, in order.
pub(super) fn run_nodes<T: Real>(
    g: &Graph,
    nodes: &[NodeId],
    own: &mut Arena<T>,
    fwd: Option<&Arena<T>>,
    params: &Params<T>,
    span: Span<'_>,
    packs: &mut Packs<T>,
) -> Result<()> {
    for &n in nodes {
        run_node(g, n, own, fwd, params, span, packs)?;
    }
    Ok(())
}

/// For an op that asks for a packed weight operand (small-row matrix
/// products against a parameter), packs the parameter once per pass and
/// returns its cache key.
pub(super) fn packed_weight<T: Real>(
    g: &Graph,
    node: &ramus_core::Node,
    op: &dyn ramus_core::OpDef,
    range: Range,
    params: &Params<T>,
    packs: &mut Packs<T>,
) -> Option<(ParamId, bool)> {
    let want = op.packed_operand()?;
    let (&a, &b) = (node.inputs.first()?, node.inputs.get(1)?);
    let NodeKind::Param(p) = g.nodes[b].kind else {
        return None;
    };
    let rows = match g.nodes[a].ty.space {
        Space::Vertex => range.r1 - range.r0,
        Space::Edge => range.e1 - range.e0,
        Space::Static => return None,
    };
    let shape = params.values[p].shape();
    if rows > want.rows_limit || shape.len() != 2 {
        return None;
    }
    let key = (p, want.trans_b);
    packs.entry(key).or_insert_with(|| {
        let (k, n) = if want.trans_b {
            (shape[1], shape[0])
        } else {
            (shape[0], shape[1])
        };
        PackedB::pack(params.values[p].data(), shape[1], k, n, want.trans_b)
    });
    Some(key)
}

/// Runs op node `n` of `g` over `span`.
pub(super) fn run_node<T: Real>(
    g: &Graph,
    n: NodeId,
    own: &mut Arena<T>,
    fwd: Option<&Arena<T>>,
    params: &Params<T>,
    span: Span<'_>,
    packs: &mut Packs<T>,
) -> Result<()> {
    let Span { range, edge_parent } = span;
    let node = &g.nodes[n];
    let NodeKind::Op(op) = &node.kind else {
        return Ok(());
    };
    let substitute = if own.inference {
        op.inference_op(node.inputs.len())
    } else {
        None
    };
    let op = substitute.as_ref().unwrap_or(op);
    let packed_key = packed_weight(g, node, op, range, params, packs);
    // synchronized batch norm: the training pass's batch statistics over the ranks
    let share = match op {
        Op::BatchNorm(_) | Op::BatchNormBackwardInput(_) | Op::BatchNormBackwardGamma(_) => {
            own.norm_sync.clone()
        }
        _ => None,
    };
    let mut sync = share.as_ref().map(norm_sync::lock).transpose()?;
    let packs = &*packs;
    let mut out = std::mem::take(&mut own.vals[n]);
    let result = (|| {
        let mut args: Vec<Arg<'_, T>> = Vec::with_capacity(node.inputs.len());
        for &i in &node.inputs {
            let ty = &g.nodes[i].ty;
            let (lo, hi) = match ty.space {
                Space::Vertex => (range.r0, range.r1),
                Space::Edge => (range.e0, range.e1),
                Space::Static => (0, 1),
            };
            let wdt = ty.width();
            let data = match (&g.nodes[i].kind, ty.dtype) {
                (NodeKind::Param(p), _) => ArgData::Float(params.values[*p].data()),
                (_, DType::Float) => {
                    ArgData::Float(&resolve_floats(g, i, own, fwd)?[lo * wdt..hi * wdt])
                }
                (_, DType::Index) => {
                    ArgData::Index(&resolve_indices(g, i, own, fwd)?[lo * wdt..hi * wdt])
                }
            };
            args.push(Arg {
                ty,
                rows: hi - lo,
                data,
            });
        }
        let (lo, hi) = match node.ty.space {
            Space::Vertex => (range.r0, range.r1),
            Space::Edge => (range.e0, range.e1),
            Space::Static => (0, 1),
        };
        let wdt = node.ty.width();
        let mut ctx = KernelCtx {
            args: &args,
            out: &mut out[lo * wdt..hi * wdt],
            out_rows: hi - lo,
            vertex_rows: range.r1 - range.r0,
            edge_parent,
            packed_b: packed_key.and_then(|key| packs.get(&key)),
            norm_sum: sync.as_deref_mut().map(|s| s as &mut dyn NormSum),
        };
        kernels::run(op, &mut ctx).map_err(ExecError::from)
    })();
    own.vals[n] = out;
    result.map_err(|e| match e {
        ExecError::Core(CoreError::Kernel { op, message }) => ExecError::Core(CoreError::Kernel {
            op,
            message: format!("{message} (node %{n})"),
        }),
        e => e,
    })
}

/// Appends to `updates` the new running statistics of every batch
/// normalisation with running statistics in `g` (a `BatchNorm` node with 5
/// inputs whose last two are parameters), from its input's `rows` rows in
/// `arena` after a train-mode forward pass. A buffer already in `updates`
/// continues from its pending value.
pub(super) fn running_stat_updates<T: Real>(
    g: &Graph,
    arena: &Arena<T>,
    params: &Params<T>,
    rows: usize,
    updates: &mut Vec<(ParamId, Vec<T>)>,
) -> Result<()> {
    for node in &g.nodes {
        let Some(Op::BatchNorm(BatchNorm(norm))) = node.op() else {
            continue;
        };
        let [x, _, _, mean, var] = node.inputs[..] else {
            continue;
        };
        let (NodeKind::Param(pm), NodeKind::Param(pv)) = (&g.nodes[mean].kind, &g.nodes[var].kind)
        else {
            return Err(ExecError::Input(format!(
                "batch normalisation's running statistics (nodes %{mean}, %{var}) must be parameters"
            )));
        };
        let current = |p: ParamId| -> Result<Vec<T>> {
            if let Some((_, v)) = updates.iter().rev().find(|(q, _)| *q == p) {
                return Ok(v.clone());
            }
            params
                .values
                .get(p)
                .map(|t| t.data().to_vec())
                .ok_or_else(|| ExecError::Input(format!("no parameter {p}")))
        };
        let (mut m, mut v) = (current(*pm)?, current(*pv)?);
        let values = resolve_floats(g, x, arena, None)?;
        let used = rows * norm.channels * norm.spatial;
        let values = values.get(..used).ok_or_else(|| {
            ExecError::Input(format!(
                "batch normalisation input %{x} holds {} values, expected {used}",
                values.len()
            ))
        })?;
        let mut sync = arena.norm_sync.as_ref().map(norm_sync::lock).transpose()?;
        if let Some(sync) = sync.as_mut() {
            sync.running(*norm, *pm, *pv);
        }
        let sync = sync.as_deref_mut().map(|s| s as &mut dyn NormSum);
        update_running_stats(norm, (values, rows), &mut m, &mut v, sync)?;
        updates.push((*pm, m));
        updates.push((*pv, v));
    }
    Ok(())
}

/// Adds the graph's parameter-gradient outputs into `grads`.
pub(super) fn accumulate_param_grads<T: Real>(
    g: &Graph,
    own: &Arena<T>,
    fwd: Option<&Arena<T>>,
    grads: &mut Grads<T>,
) -> Result<()> {
    for o in &g.outputs {
        match o.role {
            Role::ParamGrad(p) => {
                let src = resolve_floats(g, o.node, own, fwd)?;
                grads.mark_dense(p);
                let dst = grads.values[p].data_mut();
                ramus_core::simd!(for (d, &x) in dst.iter_mut().zip(src) {
                    *d += x;
                });
            }
            Role::ParamRowGrad(p) => {
                let values = resolve_floats(g, o.node, own, fwd)?;
                let index = resolve_indices(g, o.aux.unwrap_or(o.node), own, fwd)?;
                let width = grads.row_width(p);
                let rows = grads.values[p].shape().first().copied().unwrap_or(0);
                for (r, &i) in index.iter().enumerate() {
                    if i as usize >= rows {
                        return Err(ExecError::Input(format!(
                            "row index {i} out of range for a parameter of {rows} rows"
                        )));
                    }
                    grads.mark_row(p, i);
                    let dst = &mut grads.values[p].data_mut()
                        [i as usize * width..(i as usize + 1) * width];
                    for (d, &x) in dst.iter_mut().zip(&values[r * width..(r + 1) * width]) {
                        *d += x;
                    }
                }
            }
            _ => {}
        }
    }
    Ok(())
}
