//! A batch's inputs beside its graphs: dropout masks (drawn the same way,
//! in the same order, by every engine) and the values `pull` reads.

use ramus_core::graph::{Graph, NodeKind, Source};
use ramus_core::Real;
use ramus_graph::Schedule;

use rand::Rng;
use rand_chacha::ChaCha8Rng;

use crate::error::{EngineError, Result};

use super::Arena;

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

/// Fills one dropout mask: Bernoulli keep masks scaled by `1 / (1 - rate)`
/// while training (`rate_units` in 1e-4, one draw per element from `rng`),
/// ones otherwise. Every engine draws masks through this, in the same order
/// (functions' forward graphs, then the head), so their results agree.
pub fn fill_dropout_mask<T: Real>(
    out: &mut [T],
    rate_units: u16,
    training: bool,
    rng: &mut ChaCha8Rng,
) {
    let rate = f64::from(rate_units) * 1e-4;
    let keep = T::from_f64(1.0 / (1.0 - rate));
    for x in out.iter_mut() {
        *x = if !training {
            T::ONE
        } else if rng.random::<f64>() < rate {
            T::ZERO
        } else {
            keep
        };
    }
}

/// Checks the values a `pull(width)` reads for a batch: explicit pull
/// values (`explicit`) or the graphs' own features, `width` floats per
/// vertex number.
pub fn pulled_values<'a, T>(
    values: &'a [T],
    s: &Schedule,
    width: usize,
    function: &str,
    explicit: bool,
) -> Result<&'a [T]> {
    if !explicit && s.feature_width != width {
        return Err(EngineError::Input(if s.feature_width == 0 {
            format!(
                "vertex function `{function}` pulls {width} floats per vertex, but the graphs carry no features and no pull values were supplied"
            )
        } else {
            format!(
                "vertex function `{function}` pulls {width} floats per vertex, but the graphs carry {} features per vertex",
                s.feature_width
            )
        }));
    }
    if values.len() != s.num_vertices() * width {
        return Err(EngineError::Input(format!(
            "pull values hold {} floats, expected {} vertices x {width}",
            values.len(),
            s.num_vertices()
        )));
    }
    Ok(values)
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
