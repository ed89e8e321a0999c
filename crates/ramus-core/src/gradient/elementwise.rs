//! Gradients of element-wise ops: each input's gradient from the output's.

use super::{GradCtx, Gradient};
use crate::ops::*;

macro_rules! unary_grad {
    ($ty:ident, |$g:ident| $grad:expr) => {
        impl Gradient for $ty {
            fn gradient(&self, $g: &mut GradCtx<'_>) {
                let d = $grad;
                $g.set(0, d);
            }
        }
    };
}

macro_rules! scalar_grad {
    ($ty:ident, |$g:ident, $s:ident| $grad:expr) => {
        impl Gradient for $ty {
            fn gradient(&self, $g: &mut GradCtx<'_>) {
                let $s = self.0;
                let d = $grad;
                $g.set(0, d);
            }
        }
    };
}

macro_rules! binary_grad {
    ($ty:ident, |$g:ident| $grad:block) => {
        impl Gradient for $ty {
            fn gradient(&self, $g: &mut GradCtx<'_>) $grad
        }
    };
}

unary_grad!(Neg, |g| {
    let gr = g.grad();
    g.b.neg(gr)
});
unary_grad!(Exp, |g| {
    let (gr, y) = (g.grad(), g.output());
    g.b.mul(gr, y)
});
unary_grad!(Log, |g| {
    let (gr, x) = (g.grad(), g.input(0));
    g.b.div(gr, x)
});
unary_grad!(Sigmoid, |g| {
    let (gr, y) = (g.grad(), g.output());
    g.b.sigmoid_backward(y, gr)
});
unary_grad!(Tanh, |g| {
    let (gr, y) = (g.grad(), g.output());
    g.b.tanh_backward(y, gr)
});
unary_grad!(Relu, |g| {
    let (gr, y) = (g.grad(), g.output());
    g.b.relu_backward(y, gr)
});
scalar_grad!(Scale, |g, s| {
    let gr = g.grad();
    g.b.scale(gr, s)
});
scalar_grad!(AddScalar, |g, _s| g.grad());
scalar_grad!(RsubScalar, |g, _s| {
    let gr = g.grad();
    g.b.neg(gr)
});
binary_grad!(Add, |g| {
    let gr = g.grad();
    g.set(0, gr);
    g.set(1, gr);
});
binary_grad!(Sub, |g| {
    let gr = g.grad();
    g.set(0, gr);
    let n = g.b.neg(gr);
    g.set(1, n);
});
binary_grad!(Mul, |g| {
    let (gr, a, b) = (g.grad(), g.input(0), g.input(1));
    let da = g.b.mul(gr, b);
    g.set(0, da);
    let db = g.b.mul(gr, a);
    g.set(1, db);
});
binary_grad!(Div, |g| {
    let (gr, b, y) = (g.grad(), g.input(1), g.output());
    let da = g.b.div(gr, b);
    g.set(0, da);
    let t = g.b.mul(da, y);
    let db = g.b.neg(t);
    g.set(1, db);
});
binary_grad!(SigmoidBackward, |g| {
    let (gr, y, up) = (g.grad(), g.input(0), g.input(1));
    // d/dy = up * (1 - 2y); d/dup = y (1 - y)
    let two_y = g.b.scale(y, 2.0);
    let one_minus = g.b.rsub_scalar(two_y, 1.0);
    let t = g.b.mul(up, one_minus);
    let dy = g.b.mul(gr, t);
    g.set(0, dy);
    let dup = g.b.sigmoid_backward(y, gr);
    g.set(1, dup);
});
binary_grad!(TanhBackward, |g| {
    let (gr, y, up) = (g.grad(), g.input(0), g.input(1));
    // d/dy = -2 y up; d/dup = 1 - y^2
    let t = g.b.mul(y, up);
    let t = g.b.mul(t, gr);
    let dy = g.b.scale(t, -2.0);
    g.set(0, dy);
    let dup = g.b.tanh_backward(y, gr);
    g.set(1, dup);
});
binary_grad!(ReluBackward, |g| {
    let (gr, x) = (g.grad(), g.input(0));
    let dup = g.b.relu_backward(x, gr);
    g.set(1, dup);
});
