//! Elementwise ops: unary math, scalar ops and binary arithmetic with
//! broadcasting of a static row (bias). Each carries a C code template used
//! by fusion code generation; its CPU kernel, applied row by row, is in the
//! CPU engine (`ramus_cpu::kernels`).

use crate::op::{want_float, GradCtx, OpDef};
use crate::types::ValueType;

/// Type inference shared by all elementwise ops: float operands; row
/// operands agree in space and width; static operands broadcast as rows of
/// that width; all-static operands must have equal shapes.
pub(crate) fn infer_elementwise(inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
    for (i, t) in inputs.iter().enumerate() {
        want_float(t, &format!("operand {i}"))?;
    }
    let rows: Vec<&&ValueType> = inputs.iter().filter(|t| t.is_rows()).collect();
    if let Some(first) = rows.first() {
        for t in &rows {
            if t.space != first.space || t.width() != first.width() {
                return Err(format!("row operands differ: {first} vs {t}"));
            }
        }
        for t in inputs.iter().filter(|t| !t.is_rows()) {
            if !t.is_broadcast_row(first.width()) {
                return Err(format!(
                    "static operand {t} does not broadcast over rows of width {}",
                    first.width()
                ));
            }
        }
        Ok(ValueType::rows(first.space, first.width()))
    } else {
        let first = inputs.first().ok_or("needs at least one operand")?;
        if inputs.iter().any(|t| t.shape != first.shape) {
            return Err("static operands must have equal shapes".into());
        }
        Ok(ValueType::fixed(&first.shape))
    }
}

macro_rules! unary_op {
    ($(#[$doc:meta])* $ty:ident, $name:literal, $tmpl:literal, |$g:ident| $grad:expr) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug)]
        pub struct $ty;
        impl OpDef for $ty {
            fn name(&self) -> &'static str {
                $name
            }
            fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
                crate::op::want_arity(inputs, 1)?;
                infer_elementwise(inputs)
            }
            fn gradient(&self, $g: &mut GradCtx<'_>) {
                let d = $grad;
                $g.set(0, d);
            }
            fn elementwise_template(&self) -> Option<String> {
                Some($tmpl.to_string())
            }
        }
    };
}

unary_op!(
    /// `-x`
    Neg, "neg", "(-{0})", |g| { let gr = g.grad(); g.b.neg(gr) }
);
unary_op!(
    /// `exp(x)`
    Exp, "exp", "expf({0})", |g| { let (gr, y) = (g.grad(), g.output()); g.b.mul(gr, y) }
);
unary_op!(
    /// Natural logarithm.
    Log, "log", "logf({0})", |g| { let (gr, x) = (g.grad(), g.input(0)); g.b.div(gr, x) }
);
unary_op!(
    /// Logistic sigmoid.
    Sigmoid, "sigmoid", "(1.0f / (1.0f + expf(-{0})))", |g| { let (gr, y) = (g.grad(), g.output()); g.b.sigmoid_backward(y, gr) }
);
unary_op!(
    /// Hyperbolic tangent.
    Tanh, "tanh", "tanhf({0})", |g| { let (gr, y) = (g.grad(), g.output()); g.b.tanh_backward(y, gr) }
);
unary_op!(
    /// `max(x, 0)`. Its gradient reads the output (`y > 0` exactly where
    /// `x > 0`), so a ReLU's input need not outlive the forward pass: after a
    /// batch norm that is a whole activation tensor per layer less to keep
    /// (or to swap) until backward.
    Relu, "relu", "fmaxf({0}, 0.0f)", |g| { let (gr, y) = (g.grad(), g.output()); g.b.relu_backward(y, gr) }
);

macro_rules! scalar_op {
    ($(#[$doc:meta])* $ty:ident, $name:literal, $tmpl:literal, |$g:ident, $s:ident| $grad:expr) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug)]
        pub struct $ty(pub f64);
        impl OpDef for $ty {
            fn name(&self) -> &'static str {
                $name
            }
            fn attrs(&self) -> String {
                format!("{}", self.0)
            }
            fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
                crate::op::want_arity(inputs, 1)?;
                if !self.0.is_finite() {
                    return Err(format!("scalar {} is not finite", self.0));
                }
                infer_elementwise(inputs)
            }
            fn gradient(&self, $g: &mut GradCtx<'_>) {
                let $s = self.0;
                let d = $grad;
                $g.set(0, d);
            }
            fn elementwise_template(&self) -> Option<String> {
                Some(format!($tmpl, a = format!("{:?}f", self.0 as f32)))
            }
        }
    };
}

scalar_op!(
    /// `a * x`
    Scale, "scale", "({a} * {{0}})", |g, s| { let gr = g.grad(); g.b.scale(gr, s) }
);
scalar_op!(
    /// `x + a`
    AddScalar, "add_scalar", "({{0}} + {a})", |g, _s| g.grad()
);
scalar_op!(
    /// `a - x`
    RsubScalar, "rsub_scalar", "({a} - {{0}})", |g, _s| { let gr = g.grad(); g.b.neg(gr) }
);

macro_rules! binary_op {
    ($(#[$doc:meta])* $ty:ident, $name:literal, $tmpl:literal, |$g:ident| $grad:block) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug)]
        pub struct $ty;
        impl OpDef for $ty {
            fn name(&self) -> &'static str {
                $name
            }
            fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
                crate::op::want_arity(inputs, 2)?;
                infer_elementwise(inputs)
            }
            fn gradient(&self, $g: &mut GradCtx<'_>) $grad
            fn elementwise_template(&self) -> Option<String> {
                Some($tmpl.to_string())
            }
        }
    };
}

binary_op!(
    /// `a + b`
    Add, "add", "({0} + {1})", |g| {
        let gr = g.grad();
        g.set(0, gr);
        g.set(1, gr);
    }
);
binary_op!(
    /// `a - b`
    Sub, "sub", "({0} - {1})", |g| {
        let gr = g.grad();
        g.set(0, gr);
        let n = g.b.neg(gr);
        g.set(1, n);
    }
);
binary_op!(
    /// `a * b`
    Mul, "mul", "({0} * {1})", |g| {
        let (gr, a, b) = (g.grad(), g.input(0), g.input(1));
        let da = g.b.mul(gr, b);
        g.set(0, da);
        let db = g.b.mul(gr, a);
        g.set(1, db);
    }
);
binary_op!(
    /// `a / b`
    Div, "div", "({0} / {1})", |g| {
        let (gr, b, y) = (g.grad(), g.input(1), g.output());
        let da = g.b.div(gr, b);
        g.set(0, da);
        let t = g.b.mul(da, y);
        let db = g.b.neg(t);
        g.set(1, db);
    }
);
binary_op!(
    /// `g * y * (1 - y)`: the sigmoid derivative given its output `y` and upstream gradient `g`.
    SigmoidBackward, "sigmoid_backward", "({1} * {0} * (1.0f - {0}))", |g| {
        let (gr, y, up) = (g.grad(), g.input(0), g.input(1));
        // d/dy = up * (1 - 2y); d/dup = y (1 - y)
        let two_y = g.b.scale(y, 2.0);
        let one_minus = g.b.rsub_scalar(two_y, 1.0);
        let t = g.b.mul(up, one_minus);
        let dy = g.b.mul(gr, t);
        g.set(0, dy);
        let dup = g.b.sigmoid_backward(y, gr);
        g.set(1, dup);
    }
);
binary_op!(
    /// `g * (1 - y^2)`: the tanh derivative given its output `y` and upstream gradient `g`.
    TanhBackward, "tanh_backward", "({1} * (1.0f - {0} * {0}))", |g| {
        let (gr, y, up) = (g.grad(), g.input(0), g.input(1));
        // d/dy = -2 y up; d/dup = 1 - y^2
        let t = g.b.mul(y, up);
        let t = g.b.mul(t, gr);
        let dy = g.b.scale(t, -2.0);
        g.set(0, dy);
        let dup = g.b.tanh_backward(y, gr);
        g.set(1, dup);
    }
);
binary_op!(
    /// `x > 0 ? g : 0`: the relu derivative given its input or its output
    /// `x` (both are positive at the same places) and upstream gradient `g`.
    ReluBackward, "relu_backward", "({0} > 0.0f ? {1} : 0.0f)", |g| {
        let (gr, x) = (g.grad(), g.input(0));
        let dup = g.b.relu_backward(x, gr);
        g.set(1, dup);
    }
);
