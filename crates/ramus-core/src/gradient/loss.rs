//! Gradients of the softmax cross-entropy loss.

use super::{GradCtx, Gradient};
use crate::ops::*;

impl Gradient for SoftmaxXent {
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let (x, l, gr) = (g.input(0), g.input(1), g.grad());
        let d = g.b.apply(SoftmaxXentBackward, &[x, l, gr]);
        g.set(0, d);
    }
}

impl Gradient for SoftmaxXentBackward {
    fn gradient(&self, g: &mut GradCtx<'_>) {
        g.b.fail(
            "softmax_xent_backward",
            "second derivatives of the loss are not supported",
        );
    }
}
