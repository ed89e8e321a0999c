//! Gradients of the per-row matrix product.

use super::{GradCtx, Gradient};
use crate::ops::*;

impl Gradient for RowMatMul {
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let (a, b, dc) = (g.input(0), g.input(1), g.grad());
        let RowMatMul { m, k, n, .. } = *self;
        let prod = |ta, tb, m, k, n| RowMatMul {
            m,
            k,
            n,
            trans_a: ta,
            trans_b: tb,
        };
        // gradients of the stored operands (the same pattern as `MatMul`)
        let (da, db) = match (self.trans_a, self.trans_b) {
            (false, false) => (
                g.b.row_matmul(dc, b, prod(false, true, m, n, k)),
                g.b.row_matmul(a, dc, prod(true, false, k, m, n)),
            ),
            (false, true) => (
                g.b.row_matmul(dc, b, prod(false, false, m, n, k)),
                g.b.row_matmul(dc, a, prod(true, false, n, m, k)),
            ),
            (true, false) => (
                g.b.row_matmul(b, dc, prod(false, true, k, n, m)),
                g.b.row_matmul(a, dc, prod(false, false, k, m, n)),
            ),
            (true, true) => (
                g.b.row_matmul(b, dc, prod(true, true, k, n, m)),
                g.b.row_matmul(dc, a, prod(true, true, n, m, k)),
            ),
        };
        g.set(0, da);
        g.set(1, db);
    }
}
