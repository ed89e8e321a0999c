//! The CPU evaluator of fused groups ([`eval_group`]): a
//! [`FusedGroup`] of `ramus_core::fusion` run op by op through its members'
//! CPU kernels, with the buffers the generated CUDA kernel
//! (`ramus_codegen::fused`) takes. It is the oracle the generated code is
//! tested against.

use std::slice;

use ramus_core::error::{CoreError, Result};
use ramus_core::fusion::{group_error, node_error, FusedGroup, InputKind};
use ramus_core::graph::{Graph, NodeId, Space};
use ramus_core::real::Real;

use crate::kernels::{self, Arg, ArgData, KernelCtx};

/// Evaluates the group op by op through the members' CPU kernels, with
/// the buffers the generated kernel takes:
///
/// * `inputs[k]` holds input `k`: rows × width elements (per element),
///   `width` (broadcast), for an [`InputKind::Window`] the whole
///   *source* buffer (rows × stride elements) the window is read from,
///   and for an [`InputKind::ChildSum`] / [`InputKind::ParentRow`] the
///   whole *source* buffer (edges × width / vertex rows × width);
/// * `csr_rows[c]` is the index array of the `c`-th CSR input (see
///   [`InputKind::is_csr`]; in input order), *relative* to the source
///   (the kernel's base already subtracted): for a `ChildSum`, rows + 1
///   non-decreasing offsets into the source's edge rows; for a
///   `ParentRow`, one source row per row (edge) of the group;
/// * `outputs[k]` receives output `k` (rows × width);
/// * `concats[k]` is the buffer (rows × its width) of the `k`-th concat
///   of [`concat_targets`](FusedGroup::concat_targets) (one buffer per concat,
///   however many members go into it); only the columns this group
///   writes change.
///
/// `rows` is ignored for a static group (one "row" of `width` elements).
/// Buffers of the wrong length and indices outside their source are
/// errors naming the input.
pub fn eval_group<T: Real>(
    group: &FusedGroup,
    graph: &Graph,
    inputs: &[&[T]],
    csr_rows: &[&[u32]],
    rows: usize,
    outputs: &mut [&mut [T]],
    concats: &mut [&mut [T]],
) -> Result<()> {
    group.members_code(graph)?;
    let output_members = group.output_members()?;
    let write_members = group.concat_write_members()?;
    let targets = group.concat_targets();
    check_buffer_counts(group, &targets, inputs, csr_rows, outputs, concats)?;
    let rows = if group.space == Space::Static {
        1
    } else {
        rows
    };
    let n = elements(group, rows, group.width)?;
    // window and inline inputs, gathered into rows × width
    let mut gathered: Vec<Option<Vec<T>>> = Vec::with_capacity(group.inputs.len());
    let mut csr = csr_rows.iter();
    for (k, data) in inputs.iter().enumerate() {
        gathered.push(gather_input(group, k, data, &mut csr, rows)?);
    }
    if let Some((k, o)) = outputs.iter().enumerate().find(|(_, o)| o.len() != n) {
        return Err(group_error(
            group,
            format!(
                "output {k} (%{}) has {} elements, expected {n}",
                group.outputs[k],
                o.len()
            ),
        ));
    }
    for (k, (&c, buf)) in targets.iter().zip(concats.iter()).enumerate() {
        let stride = graph.nodes[c].ty.width();
        let need = elements(group, rows, stride)?;
        if buf.len() != need {
            return Err(group_error(
                group,
                format!(
                    "concat buffer {k} (%{c}) has {} elements, expected {need}",
                    buf.len()
                ),
            ));
        }
    }
    let values = run_members(group, graph, inputs, &gathered, rows)?;
    for (out, &j) in outputs.iter_mut().zip(&output_members) {
        out.copy_from_slice(&values[j]);
    }
    for (w, &j) in group.concat_writes.iter().zip(&write_members) {
        let Some(t) = targets.iter().position(|&c| c == w.concat) else {
            continue;
        };
        let buf = &mut concats[t];
        for (r, src) in values[j].chunks(group.width.max(1)).take(rows).enumerate() {
            let at = r * w.stride + w.offset;
            buf[at..at + src.len()].copy_from_slice(src);
        }
    }
    Ok(())
}

/// Checks that [`eval_group`] got one buffer per input, CSR input, output
/// and concat target.
fn check_buffer_counts<T>(
    group: &FusedGroup,
    targets: &[NodeId],
    inputs: &[&[T]],
    csr_rows: &[&[u32]],
    outputs: &[&mut [T]],
    concats: &[&mut [T]],
) -> Result<()> {
    let csr_inputs = group.inputs.iter().filter(|i| i.kind.is_csr()).count();
    if inputs.len() != group.inputs.len()
        || csr_rows.len() != csr_inputs
        || outputs.len() != group.outputs.len()
        || concats.len() != targets.len()
    {
        return Err(group_error(
            group,
            format!(
                "takes {} inputs, {} index arrays, {} outputs and {} concat buffers, \
                 got {}, {}, {} and {}",
                group.inputs.len(),
                csr_inputs,
                group.outputs.len(),
                targets.len(),
                inputs.len(),
                csr_rows.len(),
                outputs.len(),
                concats.len()
            ),
        ));
    }
    Ok(())
}

/// `rows × width` elements, or an error when that overflows.
fn elements(group: &FusedGroup, rows: usize, width: usize) -> Result<usize> {
    rows.checked_mul(width)
        .ok_or_else(|| group_error(group, format!("{rows} rows of width {width} overflow")))
}

/// Checks the buffer `data` of input `k` and, for a window or an inline
/// read, gathers its `rows × width` values (taking the inline read's index
/// array from `csr`); `None` for an input the members read as it is.
fn gather_input<T: Real>(
    group: &FusedGroup,
    k: usize,
    data: &[T],
    csr: &mut slice::Iter<'_, &[u32]>,
    rows: usize,
) -> Result<Option<Vec<T>>> {
    let input = &group.inputs[k];
    let width = group.width;
    let n = rows * width;
    let what = || format!("input {k} (%{}, {})", input.node, input.kind.short());
    let bad = |message: String| group_error(group, format!("{} {message}", what()));
    let need = match input.kind {
        InputKind::PerElement => Some(n),
        InputKind::Broadcast => Some(width),
        InputKind::Window { stride, .. } => Some(elements(group, rows, stride)?),
        // whole rows of the source, as many as there are
        InputKind::ChildSum { .. } | InputKind::ParentRow { .. } => None,
    };
    match need {
        Some(need) if data.len() != need => {
            return Err(bad(format!("has {} elements, expected {need}", data.len())));
        }
        None if width > 0 && !data.len().is_multiple_of(width) => {
            return Err(bad(format!(
                "has {} elements, not whole rows of width {width}",
                data.len()
            )));
        }
        _ => {}
    }
    Ok(match input.kind {
        InputKind::PerElement | InputKind::Broadcast => None,
        InputKind::Window { offset, stride, .. } => {
            let mut w = Vec::with_capacity(n);
            for r in 0..rows {
                let at = r * stride + offset;
                w.extend_from_slice(&data[at..at + width]);
            }
            Some(w)
        }
        InputKind::ChildSum { .. } => {
            let offsets = csr.next().copied().unwrap_or_default();
            Some(sum_child_rows(data, offsets, rows, width, &bad)?)
        }
        InputKind::ParentRow { .. } => {
            let parents = csr.next().copied().unwrap_or_default();
            Some(parent_rows(data, parents, rows, width, &bad)?)
        }
    })
}

/// Rows of the source of an inline read (nothing is read at width 0).
fn source_rows<T>(data: &[T], width: usize) -> usize {
    data.len().checked_div(width).unwrap_or(usize::MAX)
}

/// An inlined `sum_children`: row `r` is the sum of the source's edge rows
/// `offsets[r]..offsets[r + 1]`. `bad` names the input in errors.
fn sum_child_rows<T: Real>(
    data: &[T],
    offsets: &[u32],
    rows: usize,
    width: usize,
    bad: &dyn Fn(String) -> CoreError,
) -> Result<Vec<T>> {
    if offsets.len().checked_sub(1) != Some(rows) {
        return Err(bad(format!(
            "has {} CSR offsets, expected {rows} + 1 (one per row and an end)",
            offsets.len()
        )));
    }
    let source_rows = source_rows(data, width);
    let mut w = vec![T::ZERO; rows * width];
    for (r, pair) in offsets.windows(2).enumerate() {
        let (lo, hi) = (pair[0] as usize, pair[1] as usize);
        if lo > hi || hi > source_rows {
            return Err(bad(format!(
                "row {r} sums edges {lo}..{hi}, outside the source's \
                 {source_rows} edge rows"
            )));
        }
        let acc = &mut w[r * width..(r + 1) * width];
        for e in lo..hi {
            for (a, &x) in acc.iter_mut().zip(&data[e * width..(e + 1) * width]) {
                *a += x;
            }
        }
    }
    Ok(w)
}

/// An inlined `expand_children`: edge row `e` is the source's row
/// `parents[e]`. `bad` names the input in errors.
fn parent_rows<T: Real>(
    data: &[T],
    parents: &[u32],
    rows: usize,
    width: usize,
    bad: &dyn Fn(String) -> CoreError,
) -> Result<Vec<T>> {
    if parents.len() != rows {
        return Err(bad(format!(
            "has {} parent rows, expected {rows} (one per edge)",
            parents.len()
        )));
    }
    let source_rows = source_rows(data, width);
    let mut w = Vec::with_capacity(rows * width);
    for (e, &p) in parents.iter().enumerate() {
        let p = p as usize;
        if p >= source_rows {
            return Err(bad(format!(
                "edge {e} has parent row {p}, outside the source's \
                 {source_rows} rows"
            )));
        }
        w.extend_from_slice(&data[p * width..(p + 1) * width]);
    }
    Ok(w)
}

/// Every member's value (`rows × width`), member by member through its CPU
/// kernel, reading earlier members, the gathered inputs and the others as
/// they are.
fn run_members<T: Real>(
    group: &FusedGroup,
    graph: &Graph,
    inputs: &[&[T]],
    gathered: &[Option<Vec<T>>],
    rows: usize,
) -> Result<Vec<Vec<T>>> {
    let n = rows * group.width;
    let mut values: Vec<Vec<T>> = Vec::with_capacity(group.nodes.len());
    for (j, &m) in group.nodes.iter().enumerate() {
        let node = &graph.nodes[m];
        let op = node
            .op()
            .ok_or_else(|| node_error(graph, m, "fused member is not an op node"))?;
        let mut out = vec![T::ZERO; n];
        {
            let mut args = Vec::with_capacity(node.inputs.len());
            for &x in &node.inputs {
                let data: &[T] = match group.nodes[..j].iter().position(|&p| p == x) {
                    Some(p) => &values[p],
                    None => {
                        let k = group
                            .inputs
                            .iter()
                            .position(|i| i.node == x)
                            .ok_or_else(|| {
                                node_error(graph, m, format!("operand %{x} is not available"))
                            })?;
                        match &gathered[k] {
                            Some(w) => w,
                            None => inputs[k],
                        }
                    }
                };
                let ty = &graph.nodes[x].ty;
                args.push(Arg {
                    ty,
                    rows: if ty.is_rows() { rows } else { 1 },
                    data: ArgData::Float(data),
                });
            }
            let mut ctx = KernelCtx {
                args: &args,
                out: &mut out,
                out_rows: rows,
                // elementwise kernels do not look at the row topology
                vertex_rows: rows,
                edge_parent: &[],
                packed_b: None,
                norm_sum: None,
            };
            kernels::run(op, &mut ctx)
                .map_err(|e| node_error(graph, m, format!("in {}: {e}", group.describe())))?;
        }
        values.push(out);
    }
    Ok(values)
}
