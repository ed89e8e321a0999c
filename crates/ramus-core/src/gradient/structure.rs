//! Gradients of the structure ops (concat, slice, pad, child sums, row reductions, reshape, embeddings).

use super::{GradCtx, Gradient};
use crate::ops::*;

impl Gradient for Concat {
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let gr = g.grad();
        let mut start = 0;
        for i in 0..g.inputs_len() {
            let w = g.input_type(i).map(|t| t.width()).unwrap_or(0);
            let s = g.b.slice(gr, start, w);
            g.set(i, s);
            start += w;
        }
    }
}

impl Gradient for Slice {
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let total = g.input_type(0).map(|t| t.width()).unwrap_or(0);
        let gr = g.grad();
        let p = g.b.pad(gr, self.start, total);
        g.set(0, p);
    }
}

impl Gradient for Pad {
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let w = g.input_type(0).map(|t| t.width()).unwrap_or(0);
        let gr = g.grad();
        let s = g.b.slice(gr, self.start, w);
        g.set(0, s);
    }
}

impl Gradient for SumChildren {
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let gr = g.grad();
        let e = g.b.expand_children(gr);
        g.set(0, e);
    }
}

impl Gradient for ExpandChildren {
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let gr = g.grad();
        let s = g.b.sum_children(gr);
        g.set(0, s);
    }
}

impl Gradient for SumRows {
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let (gr, x) = (g.grad(), g.input(0));
        let b = g.b.broadcast_rows(gr, x, self.mean);
        g.set(0, b);
    }
}

impl Gradient for BroadcastRows {
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let gr = g.grad();
        let s = g.b.apply(SumRows { mean: self.mean }, &[gr]);
        let shape = g.input_type(0).map(|t| t.shape).unwrap_or_default();
        let s = if g.b.ty(s).map(|t| t.shape != shape).unwrap_or(false) {
            g.b.reshape(s, &shape)
        } else {
            s
        };
        g.set(0, s);
    }
}

impl Gradient for Reshape {
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let shape = g.input_type(0).map(|t| t.shape).unwrap_or_default();
        let gr = g.grad();
        let r = g.b.reshape(gr, &shape);
        g.set(0, r);
    }
}

impl Gradient for Embedding {
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let (gr, idx) = (g.grad(), g.input(1));
        g.set_rows(0, gr, idx);
    }
}

impl Gradient for EmbeddingUnk {
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let Some(table) = g.input_type(0) else {
            return;
        };
        let (gr, idx) = (g.grad(), g.input(1));
        let rows = table.shape.first().copied().unwrap_or(0);
        let dt = g.b.apply(EmbeddingUnkBackward { rows }, &[gr, idx]);
        g.set(0, dt);
    }
}

impl Gradient for EmbeddingUnkBackward {
    fn gradient(&self, _g: &mut GradCtx<'_>) {
        // second-order gradients of embeddings are not needed
    }
}
