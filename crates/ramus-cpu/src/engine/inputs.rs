//! A batch's inputs beside its graphs on the CPU: its dropout masks (each
//! drawn by [`ramus_exec::fill_dropout_mask`], as every engine does) and
//! rows of the vertex values read.

use ramus_core::graph::{Graph, NodeKind, Source};
use ramus_core::Real;

use rand_chacha::ChaCha8Rng;

use ramus_exec::fill_dropout_mask;

use super::arena::Arena;

/// Fills every dropout mask of `g` (see [`fill_dropout_mask`]).
pub(super) fn fill_dropout_masks<T: Real>(
    g: &Graph,
    arena: &mut Arena<T>,
    training: bool,
    rng: &mut ChaCha8Rng,
) {
    for (n, node) in g.nodes.iter().enumerate() {
        if let NodeKind::Input(Source::DropoutMask { rate, .. }) = node.kind {
            fill_dropout_mask(&mut arena.vals[n], rate, training, rng);
        }
    }
}

/// Row `r` of `dst` gets row `vertex[r]` of `src` (rows of `width`), each
/// element converted.
pub(super) fn copy_vertex_rows<S: Copy, T>(
    dst: &mut [T],
    src: &[S],
    vertex: &[u32],
    width: usize,
    convert: impl Fn(S) -> T,
) {
    for (d, &v) in dst.chunks_mut(width.max(1)).zip(vertex) {
        let v = v as usize;
        for (d, &x) in d.iter_mut().zip(&src[v * width..(v + 1) * width]) {
            *d = convert(x);
        }
    }
}
