//! The closed op set: [`Op`], one variant per primitive op type. Graph
//! nodes hold an `Op`; engines and lowerings `match` on it, exhaustively
//! where they run ops, so adding a variant makes the compiler list every
//! place that must handle it. The per-op metadata (shape inference,
//! fusion template, cost) stays in each type's [`OpDef`] impl, reached
//! through [`Op::def`]; the gradients are in [`crate::gradient`]
//! (`gradient::emit`, one match over `Op`), the CPU kernels in the CPU
//! engine (`ramus_cpu::kernels::run`, one match over `Op`).

use super::cnn::*;
use super::elementwise::*;
use super::loss::{SoftmaxXent, SoftmaxXentBackward};
use super::matmul::MatMul;
use super::row_matrix::RowMatMul;
use super::structure::*;
use crate::op::{Cost, OpDef, PackedOperand};
use crate::types::ValueType;

macro_rules! op_set {
    ($($(#[$doc:meta])* $v:ident),* $(,)?) => {
        /// A primitive op (see the module docs). Each variant holds the op
        /// type of the same name, which carries its attributes.
        #[derive(Clone, Debug)]
        pub enum Op {
            $($(#[$doc])* $v($v),)*
        }

        impl Op {
            /// The op's definition: name, attributes, inference, fusion
            /// template, cost. The one match from `Op` to the per-type
            /// impls.
            pub fn def(&self) -> &dyn OpDef {
                match self {
                    $(Op::$v(o) => o,)*
                }
            }
        }

        $(impl From<$v> for Op {
            fn from(o: $v) -> Op {
                Op::$v(o)
            }
        })*
    };
}

op_set!(
    /// `-x`
    Neg,
    /// `exp(x)`
    Exp,
    /// `ln(x)`
    Log,
    /// Logistic sigmoid.
    Sigmoid,
    /// Hyperbolic tangent.
    Tanh,
    /// `max(x, 0)`
    Relu,
    /// `a * x`
    Scale,
    /// `x + a`
    AddScalar,
    /// `a - x`
    RsubScalar,
    /// `a + b`
    Add,
    /// `a - b`
    Sub,
    /// `a * b`
    Mul,
    /// `a / b`
    Div,
    /// Sigmoid derivative from its output.
    SigmoidBackward,
    /// Tanh derivative from its output.
    TanhBackward,
    /// ReLU derivative.
    ReluBackward,
    /// Matrix product of row values with a static matrix (or two statics).
    MatMul,
    /// Per-row matrix product.
    RowMatMul,
    /// Rows concatenated along features.
    Concat,
    /// A column range.
    Slice,
    /// Rows placed inside zero rows.
    Pad,
    /// Edge rows summed into their parent vertex (child-sum).
    SumChildren,
    /// Vertex rows copied to their child edges.
    ExpandChildren,
    /// Sum (or mean) over rows.
    SumRows,
    /// A static row repeated for every row of a reference.
    BroadcastRows,
    /// A static value with another shape.
    Reshape,
    /// Table rows looked up by token.
    Embedding,
    /// Table rows looked up by token, unknown tokens reading row 0.
    EmbeddingUnk,
    /// Gradient of [`EmbeddingUnk`]'s table.
    EmbeddingUnkBackward,
    /// Per-row softmax cross-entropy.
    SoftmaxXent,
    /// Gradient of [`SoftmaxXent`].
    SoftmaxXentBackward,
    /// 2-D convolution.
    Conv2d,
    /// Input gradient of [`Conv2d`].
    Conv2dBackwardInput,
    /// Weight gradient of [`Conv2d`].
    Conv2dBackwardWeight,
    /// Max pooling.
    MaxPool2d,
    /// Gradient of [`MaxPool2d`].
    MaxPool2dBackward,
    /// Per-channel mean over positions.
    GlobalAvgPool,
    /// Gradient of [`GlobalAvgPool`].
    GlobalAvgPoolBackward,
    /// Per-channel sum over rows and positions.
    ChannelSum,
    /// A per-channel static spread over positions and rows.
    ChannelBroadcast,
    /// Training-mode batch normalisation.
    BatchNorm,
    /// Input gradient of [`BatchNorm`].
    BatchNormBackwardInput,
    /// Scale gradient of [`BatchNorm`].
    BatchNormBackwardGamma,
    /// Batch normalisation with given statistics.
    BatchNormInference,
    /// Input gradient of [`BatchNormInference`].
    BatchNormInferenceBackwardInput,
    /// Statistic gradients of [`BatchNormInference`].
    BatchNormInferenceBackwardParam,
);

/// The elementwise ops (those with a fusion template:
/// [`OpDef::elementwise_template`]) as one pattern, for exhaustive matches
/// that treat them alike: `ramus_core::elementwise_op!() => ...`.
#[macro_export]
macro_rules! elementwise_op {
    () => {
        $crate::ops::Op::Neg(_)
            | $crate::ops::Op::Exp(_)
            | $crate::ops::Op::Log(_)
            | $crate::ops::Op::Sigmoid(_)
            | $crate::ops::Op::Tanh(_)
            | $crate::ops::Op::Relu(_)
            | $crate::ops::Op::Scale(_)
            | $crate::ops::Op::AddScalar(_)
            | $crate::ops::Op::RsubScalar(_)
            | $crate::ops::Op::Add(_)
            | $crate::ops::Op::Sub(_)
            | $crate::ops::Op::Mul(_)
            | $crate::ops::Op::Div(_)
            | $crate::ops::Op::SigmoidBackward(_)
            | $crate::ops::Op::TanhBackward(_)
            | $crate::ops::Op::ReluBackward(_)
    };
}

/// The image ops of [`crate::ops::cnn`] (convolution, pooling,
/// per-channel reductions, batch normalisation and their gradients) as one
/// pattern: `ramus_core::image_op!() => ...`.
#[macro_export]
macro_rules! image_op {
    () => {
        $crate::ops::Op::Conv2d(_)
            | $crate::ops::Op::Conv2dBackwardInput(_)
            | $crate::ops::Op::Conv2dBackwardWeight(_)
            | $crate::ops::Op::MaxPool2d(_)
            | $crate::ops::Op::MaxPool2dBackward(_)
            | $crate::ops::Op::GlobalAvgPool(_)
            | $crate::ops::Op::GlobalAvgPoolBackward(_)
            | $crate::ops::Op::ChannelSum(_)
            | $crate::ops::Op::ChannelBroadcast(_)
            | $crate::ops::Op::BatchNorm(_)
            | $crate::ops::Op::BatchNormBackwardInput(_)
            | $crate::ops::Op::BatchNormBackwardGamma(_)
            | $crate::ops::Op::BatchNormInference(_)
            | $crate::ops::Op::BatchNormInferenceBackwardInput(_)
            | $crate::ops::Op::BatchNormInferenceBackwardParam(_)
    };
}

impl Op {
    /// The op engines run at this op's node outside training (evaluation
    /// and inference passes), given the node's input count, with the node's
    /// inputs unchanged; `None` runs the op itself in every mode. Batch
    /// normalisation with running statistics (5 inputs) answers the
    /// inference op that normalises with them.
    pub fn inference_op(&self, arity: usize) -> Option<Op> {
        match self {
            Op::BatchNorm(BatchNorm(n)) if arity == 5 => {
                Some(Op::BatchNormInference(BatchNormInference(*n)))
            }
            _ => None,
        }
    }
}

impl Op {
    /// True for [`SumChildren`]: the child-sum reduction from edge rows to
    /// vertex rows, which every engine and lowering treats as structure.
    pub fn is_child_sum(&self) -> bool {
        matches!(self, Op::SumChildren(_))
    }
    /// True for [`ExpandChildren`]: vertex rows copied to child edges.
    pub fn is_expand_children(&self) -> bool {
        matches!(self, Op::ExpandChildren(_))
    }
    /// True for the ops that move rows between vertex and edge space
    /// ([`SumChildren`], [`ExpandChildren`]): an output row depends on
    /// rows of other vertices.
    pub fn crosses_edges(&self) -> bool {
        self.is_child_sum() || self.is_expand_children()
    }
    /// True when the op's CPU kernel maps all-zero operands to zero (in
    /// `f32`, as the kernels compute: `tanh(0)`, `0 + 0`, `a · 0` for a
    /// finite `a`; not `exp`, `sigmoid` or `0 / 0`). Ops other than the
    /// elementwise ones answer false. Refactoring of child reads
    /// ([`crate::recursion`]) asks it.
    pub fn maps_zero_to_zero(&self) -> bool {
        match self {
            Op::Neg(_)
            | Op::Tanh(_)
            | Op::Relu(_)
            | Op::Add(_)
            | Op::Sub(_)
            | Op::Mul(_)
            | Op::SigmoidBackward(_)
            | Op::TanhBackward(_)
            | Op::ReluBackward(_) => true,
            Op::Scale(Scale(a)) => (*a as f32).is_finite(),
            Op::AddScalar(AddScalar(a)) | Op::RsubScalar(RsubScalar(a)) => *a as f32 == 0.0,
            Op::Exp(_) | Op::Log(_) | Op::Sigmoid(_) | Op::Div(_) => false,
            Op::MatMul(_)
            | Op::RowMatMul(_)
            | Op::Concat(_)
            | Op::Slice(_)
            | Op::Pad(_)
            | Op::SumChildren(_)
            | Op::ExpandChildren(_)
            | Op::SumRows(_)
            | Op::BroadcastRows(_)
            | Op::Reshape(_)
            | Op::Embedding(_)
            | Op::EmbeddingUnk(_)
            | Op::EmbeddingUnkBackward(_)
            | Op::SoftmaxXent(_)
            | Op::SoftmaxXentBackward(_)
            | crate::image_op!() => false,
        }
    }
}

/// `Op` is an op definition itself, answering through [`Op::def`].
impl OpDef for Op {
    fn name(&self) -> &'static str {
        self.def().name()
    }
    fn attrs(&self) -> String {
        self.def().attrs()
    }
    fn signature(&self) -> String {
        self.def().signature()
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        self.def().infer(inputs)
    }
    fn elementwise_template(&self) -> Option<String> {
        self.def().elementwise_template()
    }
    fn packed_operand(&self) -> Option<PackedOperand> {
        self.def().packed_operand()
    }
    fn couples_rows(&self) -> bool {
        self.def().couples_rows()
    }
    fn cost(&self, inputs: &[&ValueType], out: &ValueType, rows: usize) -> Cost {
        self.def().cost(inputs, out, rows)
    }
}
