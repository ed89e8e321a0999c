//! Gradients (`FGradient`): for each primitive op, the backward ops that
//! give its inputs' gradients, emitted into the backward graph through a
//! [`GradCtx`]. Apart from the op definitions (`crate::ops`) because they
//! build graphs, and graphs hold ops. [`emit`] is one exhaustive match over
//! [`Op`]: a new op does not compile until it has a gradient here.

mod cnn;
mod elementwise;
mod loss;
mod matmul;
mod row_matrix;
mod structure;

use crate::graph::{GraphBuilder, Sym};
use crate::ops::Op;
use crate::types::{Space, ValueType};

/// The gradient of one op type.
pub(crate) trait Gradient {
    /// Emits the gradient of each input into `g`.
    fn gradient(&self, g: &mut GradCtx<'_>);
}

/// Emits the gradient of each input of `op` into `g`.
pub fn emit(op: &Op, g: &mut GradCtx<'_>) {
    match op {
        Op::Neg(o) => o.gradient(g),
        Op::Exp(o) => o.gradient(g),
        Op::Log(o) => o.gradient(g),
        Op::Sigmoid(o) => o.gradient(g),
        Op::Tanh(o) => o.gradient(g),
        Op::Relu(o) => o.gradient(g),
        Op::Scale(o) => o.gradient(g),
        Op::AddScalar(o) => o.gradient(g),
        Op::RsubScalar(o) => o.gradient(g),
        Op::Add(o) => o.gradient(g),
        Op::Sub(o) => o.gradient(g),
        Op::Mul(o) => o.gradient(g),
        Op::Div(o) => o.gradient(g),
        Op::SigmoidBackward(o) => o.gradient(g),
        Op::TanhBackward(o) => o.gradient(g),
        Op::ReluBackward(o) => o.gradient(g),
        Op::MatMul(o) => o.gradient(g),
        Op::RowMatMul(o) => o.gradient(g),
        Op::Concat(o) => o.gradient(g),
        Op::Slice(o) => o.gradient(g),
        Op::Pad(o) => o.gradient(g),
        Op::SumChildren(o) => o.gradient(g),
        Op::ExpandChildren(o) => o.gradient(g),
        Op::SumRows(o) => o.gradient(g),
        Op::BroadcastRows(o) => o.gradient(g),
        Op::Reshape(o) => o.gradient(g),
        Op::Embedding(o) => o.gradient(g),
        Op::EmbeddingUnk(o) => o.gradient(g),
        Op::EmbeddingUnkBackward(o) => o.gradient(g),
        Op::SoftmaxXent(o) => o.gradient(g),
        Op::SoftmaxXentBackward(o) => o.gradient(g),
        Op::Conv2d(o) => o.gradient(g),
        Op::Conv2dBackwardInput(o) => o.gradient(g),
        Op::Conv2dBackwardWeight(o) => o.gradient(g),
        Op::MaxPool2d(o) => o.gradient(g),
        Op::MaxPool2dBackward(o) => o.gradient(g),
        Op::GlobalAvgPool(o) => o.gradient(g),
        Op::GlobalAvgPoolBackward(o) => o.gradient(g),
        Op::ChannelSum(o) => o.gradient(g),
        Op::ChannelBroadcast(o) => o.gradient(g),
        Op::BatchNorm(o) => o.gradient(g),
        Op::BatchNormBackwardInput(o) => o.gradient(g),
        Op::BatchNormBackwardGamma(o) => o.gradient(g),
        Op::BatchNormInference(o) => o.gradient(g),
        Op::BatchNormInferenceBackwardInput(o) => o.gradient(g),
        Op::BatchNormInferenceBackwardParam(o) => o.gradient(g),
    }
}

/// One gradient contribution for an op input.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum GradTerm {
    /// A value of the input's own type.
    Dense(Sym),
    /// Rows to add into a static input at the positions given by an index
    /// value (embedding tables: only looked-up rows get gradient).
    Rows { values: Sym, index: Sym },
}

/// The view a gradient builder gets: the backward graph under construction,
/// the forward values of the op's inputs and output (as backward-graph
/// values) and the gradient flowing into the output.
pub struct GradCtx<'a> {
    pub b: &'a mut GraphBuilder,
    inputs: Vec<Sym>,
    output: Sym,
    out_grad: Sym,
    pub(crate) grads: Vec<Option<GradTerm>>,
}

impl<'a> GradCtx<'a> {
    pub(crate) fn new(
        b: &'a mut GraphBuilder,
        inputs: Vec<Sym>,
        output: Sym,
        out_grad: Sym,
    ) -> Self {
        let n = inputs.len();
        GradCtx {
            b,
            inputs,
            output,
            out_grad,
            grads: vec![None; n],
        }
    }
    /// Number of op inputs.
    pub fn inputs_len(&self) -> usize {
        self.inputs.len()
    }
    /// Forward value of input `i`.
    pub fn input(&self, i: usize) -> Sym {
        self.inputs[i]
    }
    /// Forward value of the op's output.
    pub fn output(&self) -> Sym {
        self.output
    }
    /// Gradient flowing into the output.
    pub fn grad(&self) -> Sym {
        self.out_grad
    }
    /// Type of input `i`.
    pub fn input_type(&self, i: usize) -> Option<ValueType> {
        self.b.ty(self.inputs[i]).cloned()
    }
    /// Sets the gradient of input `i`, reducing over rows when the input is
    /// a broadcast row and the gradient has rows.
    pub fn set(&mut self, i: usize, grad: Sym) {
        let (Some(in_ty), Some(g_ty)) = (self.input_type(i), self.b.ty(grad).cloned()) else {
            return;
        };
        let grad = if in_ty.space == Space::Static && g_ty.is_rows() {
            let summed = self.b.sum_rows(grad);
            if in_ty.shape
                != self
                    .b
                    .ty(summed)
                    .map(|t| t.shape.clone())
                    .unwrap_or_default()
            {
                self.b.reshape(summed, &in_ty.shape)
            } else {
                summed
            }
        } else {
            grad
        };
        self.grads[i] = Some(GradTerm::Dense(grad));
    }
    /// Sets a sparse row gradient for static input `i`.
    pub fn set_rows(&mut self, i: usize, values: Sym, index: Sym) {
        self.grads[i] = Some(GradTerm::Rows { values, index });
    }
}
