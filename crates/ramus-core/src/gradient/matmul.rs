//! Gradients of the matrix product.

use super::{GradCtx, Gradient};
use crate::ops::*;

impl Gradient for MatMul {
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let (a, b, dc) = (g.input(0), g.input(1), g.grad());
        let (da, db) = match (self.trans_a, self.trans_b) {
            (false, false) => (
                g.b.matmul(dc, b, false, true),
                g.b.matmul(a, dc, true, false),
            ),
            (false, true) => (
                g.b.matmul(dc, b, false, false),
                g.b.matmul(dc, a, true, false),
            ),
            (true, false) => (
                g.b.matmul(b, dc, false, true),
                g.b.matmul(a, dc, false, false),
            ),
            (true, true) => (g.b.matmul(b, dc, true, true), g.b.matmul(dc, a, true, true)),
        };
        g.set(0, da);
        g.set(1, db);
    }
}
