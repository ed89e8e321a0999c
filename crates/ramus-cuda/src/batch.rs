//! What the CUDA batched engine and the swap path wrapped around it both
//! know about a batch: where a node's value lives ([`Buf`], [`GraphBufs`]) and the
//! vertices the head runs on ([`head_vertices`]). A leaf module, so that
//! neither imports the other for them.

use ramus_core::graph::{Graph, Role};
use ramus_core::{HeadRows, Model};
use ramus_graph::{Schedule, NO_LABEL};

use crate::pool::DeviceView;

/// Where one node's value lives for the current batch.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Buf {
    Absent,
    Floats(DeviceView<f32>),
    Indices(DeviceView<u32>),
}

/// A graph with its nodes' buffers for the current batch (a backward
/// graph's `Forward(m)` inputs are in `fwd`, the forward graph's buffers).
#[derive(Clone, Copy)]
pub(crate) struct GraphBufs<'a> {
    pub(crate) g: &'a Graph,
    pub(crate) own: &'a [Buf],
    pub(crate) fwd: Option<&'a [Buf]>,
}

impl<'a> GraphBufs<'a> {
    pub(crate) fn new(g: &'a Graph, own: &'a [Buf], fwd: Option<&'a [Buf]>) -> Self {
        GraphBufs { g, own, fwd }
    }

    /// Each graph `f` of `graphs` with `own[f]` (and `fwd[f]`).
    pub(crate) fn each(
        graphs: impl IntoIterator<Item = &'a Graph>,
        own: &'a [Vec<Buf>],
        fwd: Option<&'a [Vec<Buf>]>,
    ) -> Vec<Self> {
        let fwd_of = |f: usize| fwd.and_then(|b| b.get(f)).map(|b| &b[..]);
        (graphs.into_iter().zip(own).enumerate())
            .map(|(f, (g, own))| GraphBufs::new(g, own, fwd_of(f)))
            .collect()
    }
}

/// The vertices the head runs on, in head-row order.
pub(crate) fn head_vertices(rows: HeadRows, s: &Schedule) -> Vec<u32> {
    match rows {
        HeadRows::Roots => s.roots.clone(),
        HeadRows::Labelled => s
            .number
            .iter()
            .copied()
            .filter(|&v| s.labels[v as usize] != NO_LABEL)
            .collect(),
    }
}

/// The rows of each of `params` (row-gradient tables) that a backward pass
/// of the batch `s` sets: the tokens of the vertices whose function's
/// backward pass writes that table's row gradient (sorted, unique).
pub(crate) fn touched_rows<'p>(
    model: &Model,
    s: &Schedule,
    params: impl IntoIterator<Item = &'p usize>,
) -> Vec<(usize, Vec<u32>)> {
    let mut lists = Vec::new();
    for &p in params {
        let mut rows: Vec<u32> = Vec::new();
        for (f, func) in model.functions.iter().enumerate() {
            let sets = |o: &ramus_core::graph::Output| o.role == Role::ParamRowGrad(p);
            if func.backward.outputs.iter().any(sets) {
                rows.extend(s.functions[f].vertex.iter().map(|&v| s.tokens[v as usize]));
            }
        }
        rows.sort_unstable();
        rows.dedup();
        lists.push((p, rows));
    }
    lists
}
