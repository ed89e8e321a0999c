//! Elementwise ops: unary math, scalar ops and binary arithmetic with
//! broadcasting of a static row (bias). Each carries a C code template used
//! by fusion code generation and a CPU kernel applied row by row.

use crate::error::Result;
use crate::graph::ValueType;
use crate::op::{want_float, GradCtx, Kernel, KernelCtx, OpDef};
use crate::real::{sigmoid, Real};

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

/// Runs `f(inputs_row, out_row)` for every output row, broadcasting static
/// operands; splits large outputs over threads.
fn run_rows<T: Real>(
    ctx: &mut KernelCtx<'_, T>,
    name: &str,
    f: impl Fn(&[&[T]], &mut [T]) + Sync,
) -> Result<()> {
    if ctx.out.is_empty() {
        return Ok(());
    }
    let rows = ctx.out_rows.max(1);
    let width = ctx.out.len() / rows;
    let mut ins: Vec<(&[T], bool)> = Vec::with_capacity(ctx.args.len());
    for a in ctx.args {
        let d = a.floats(name)?;
        let per_row = a.ty.is_rows();
        let need = if per_row { rows * width } else { width };
        if d.len() < need {
            return Err(crate::error::CoreError::kernel(
                name,
                format!("operand has {} elements, need {need}", d.len()),
            ));
        }
        ins.push((d, per_row));
    }
    let body = |r: usize, out_row: &mut [T]| {
        let mut row_ins: [&[T]; 4] = [&[]; 4];
        for (k, (d, per_row)) in ins.iter().enumerate() {
            row_ins[k] = if *per_row {
                &d[r * width..(r + 1) * width]
            } else {
                &d[..width]
            };
        }
        f(&row_ins[..ins.len()], out_row);
    };
    if rows * width >= crate::parallel::min_split_elements()
        && rows > 1
        && crate::parallel::threads() > 1
    {
        crate::parallel::for_each_chunk_mut(ctx.out, width, body);
    } else {
        for (r, o) in ctx.out.chunks_mut(width).enumerate() {
            body(r, o);
        }
    }
    Ok(())
}

macro_rules! unary_op {
    ($(#[$doc:meta])* $ty:ident, $name:literal, $tmpl:literal, |$x:ident| $f:expr, |$g:ident| $grad:expr) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug)]
        pub struct $ty;
        impl Kernel for $ty {
            fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
                run_rows(ctx, $name, |i, o| {
                    for (o, &$x) in o.iter_mut().zip(i[0]) {
                        *o = $f;
                    }
                })
            }
        }
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
    Neg, "neg", "(-{0})", |x| -x, |g| { let gr = g.grad(); g.b.neg(gr) }
);
unary_op!(
    /// `exp(x)`
    Exp, "exp", "expf({0})", |x| x.exp_fast(), |g| { let (gr, y) = (g.grad(), g.output()); g.b.mul(gr, y) }
);
unary_op!(
    /// Natural logarithm.
    Log, "log", "logf({0})", |x| x.ln(), |g| { let (gr, x) = (g.grad(), g.input(0)); g.b.div(gr, x) }
);
unary_op!(
    /// Logistic sigmoid.
    Sigmoid, "sigmoid", "(1.0f / (1.0f + expf(-{0})))", |x| sigmoid(x),
    |g| { let (gr, y) = (g.grad(), g.output()); g.b.sigmoid_backward(y, gr) }
);
unary_op!(
    /// Hyperbolic tangent.
    Tanh, "tanh", "tanhf({0})", |x| x.tanh_fast(), |g| { let (gr, y) = (g.grad(), g.output()); g.b.tanh_backward(y, gr) }
);
unary_op!(
    /// `max(x, 0)`. Its gradient reads the output (`y > 0` exactly where
    /// `x > 0`), so a ReLU's input need not outlive the forward pass: after a
    /// batch norm that is a whole activation tensor per layer less to keep
    /// (or to swap) until backward.
    Relu, "relu", "fmaxf({0}, 0.0f)", |x| if x > T::ZERO { x } else { T::ZERO },
    |g| { let (gr, y) = (g.grad(), g.output()); g.b.relu_backward(y, gr) }
);

macro_rules! scalar_op {
    ($(#[$doc:meta])* $ty:ident, $name:literal, $tmpl:literal, |$x:ident, $a:ident| $f:expr, |$g:ident, $s:ident| $grad:expr) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug)]
        pub struct $ty(pub f64);
        impl Kernel for $ty {
            fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
                let $a = T::from_f64(self.0);
                run_rows(ctx, $name, |i, o| {
                    for (o, &$x) in o.iter_mut().zip(i[0]) {
                        *o = $f;
                    }
                })
            }
        }
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
    Scale, "scale", "({a} * {{0}})", |x, a| a * x, |g, s| { let gr = g.grad(); g.b.scale(gr, s) }
);
scalar_op!(
    /// `x + a`
    AddScalar, "add_scalar", "({{0}} + {a})", |x, a| x + a, |g, _s| g.grad()
);
scalar_op!(
    /// `a - x`
    RsubScalar, "rsub_scalar", "({a} - {{0}})", |x, a| a - x, |g, _s| { let gr = g.grad(); g.b.neg(gr) }
);

macro_rules! binary_op {
    ($(#[$doc:meta])* $ty:ident, $name:literal, $tmpl:literal, |$a:ident, $b:ident| $f:expr, |$g:ident| $grad:block) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug)]
        pub struct $ty;
        impl Kernel for $ty {
            fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
                run_rows(ctx, $name, |i, o| {
                    for ((o, &$a), &$b) in o.iter_mut().zip(i[0]).zip(i[1]) {
                        *o = $f;
                    }
                })
            }
        }
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
    Add, "add", "({0} + {1})", |a, b| a + b, |g| {
        let gr = g.grad();
        g.set(0, gr);
        g.set(1, gr);
    }
);
binary_op!(
    /// `a - b`
    Sub, "sub", "({0} - {1})", |a, b| a - b, |g| {
        let gr = g.grad();
        g.set(0, gr);
        let n = g.b.neg(gr);
        g.set(1, n);
    }
);
binary_op!(
    /// `a * b`
    Mul, "mul", "({0} * {1})", |a, b| a * b, |g| {
        let (gr, a, b) = (g.grad(), g.input(0), g.input(1));
        let da = g.b.mul(gr, b);
        g.set(0, da);
        let db = g.b.mul(gr, a);
        g.set(1, db);
    }
);
binary_op!(
    /// `a / b`
    Div, "div", "({0} / {1})", |a, b| a / b, |g| {
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
    SigmoidBackward, "sigmoid_backward", "({1} * {0} * (1.0f - {0}))", |y, g| g * y * (T::ONE - y), |g| {
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
    TanhBackward, "tanh_backward", "({1} * (1.0f - {0} * {0}))", |y, g| g * (T::ONE - y * y), |g| {
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
    ReluBackward, "relu_backward", "({0} > 0.0f ? {1} : 0.0f)", |x, g| if x > T::ZERO { g } else { T::ZERO }, |g| {
        let (gr, x) = (g.grad(), g.input(0));
        let dup = g.b.relu_backward(x, gr);
        g.set(1, dup);
    }
);
