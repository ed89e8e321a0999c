//! Elementwise ops: unary math, scalar ops and binary arithmetic with
//! broadcasting of a static row (bias). Each carries a C code template used
//! by fusion code generation; its CPU kernel, applied row by row, is in the
//! CPU engine (`ramus_cpu::kernels`).

use crate::op::{want_float, OpDef};
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
    ($(#[$doc:meta])* $ty:ident, $name:literal, $tmpl:literal) => {
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
            fn elementwise_template(&self) -> Option<String> {
                Some($tmpl.to_string())
            }
        }
    };
}

unary_op!(
    /// `-x`
    Neg, "neg", "(-{0})"
);
unary_op!(
    /// `exp(x)`
    Exp, "exp", "expf({0})"
);
unary_op!(
    /// Natural logarithm.
    Log, "log", "logf({0})"
);
unary_op!(
    /// Logistic sigmoid.
    Sigmoid, "sigmoid", "(1.0f / (1.0f + expf(-{0})))"
);
unary_op!(
    /// Hyperbolic tangent.
    Tanh, "tanh", "tanhf({0})"
);
unary_op!(
    /// `max(x, 0)`. Its gradient reads the output (`y > 0` exactly where
    /// `x > 0`), so a ReLU's input need not outlive the forward pass: after a
    /// batch norm that is a whole activation tensor per layer less to keep
    /// (or to swap) until backward.
    Relu, "relu", "fmaxf({0}, 0.0f)"
);

macro_rules! scalar_op {
    ($(#[$doc:meta])* $ty:ident, $name:literal, $tmpl:literal) => {
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
            fn elementwise_template(&self) -> Option<String> {
                Some(format!($tmpl, a = format!("{:?}f", self.0 as f32)))
            }
        }
    };
}

scalar_op!(
    /// `a * x`
    Scale, "scale", "({a} * {{0}})"
);
scalar_op!(
    /// `x + a`
    AddScalar, "add_scalar", "({{0}} + {a})"
);
scalar_op!(
    /// `a - x`
    RsubScalar, "rsub_scalar", "({a} - {{0}})"
);

macro_rules! binary_op {
    ($(#[$doc:meta])* $ty:ident, $name:literal, $tmpl:literal) => {
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
            fn elementwise_template(&self) -> Option<String> {
                Some($tmpl.to_string())
            }
        }
    };
}

binary_op!(
    /// `a + b`
    Add, "add", "({0} + {1})"
);
binary_op!(
    /// `a - b`
    Sub, "sub", "({0} - {1})"
);
binary_op!(
    /// `a * b`
    Mul, "mul", "({0} * {1})"
);
binary_op!(
    /// `a / b`
    Div, "div", "({0} / {1})"
);
binary_op!(
    /// `g * y * (1 - y)`: the sigmoid derivative given its output `y` and upstream gradient `g`.
    SigmoidBackward, "sigmoid_backward", "({1} * {0} * (1.0f - {0}))"
);
binary_op!(
    /// `g * (1 - y^2)`: the tanh derivative given its output `y` and upstream gradient `g`.
    TanhBackward, "tanh_backward", "({1} * (1.0f - {0} * {0}))"
);
binary_op!(
    /// `x > 0 ? g : 0`: the relu derivative given its input or its output
    /// `x` (both are positive at the same places) and upstream gradient `g`.
    ReluBackward, "relu_backward", "({0} > 0.0f ? {1} : 0.0f)"
);
