//! The CPU kernels of the primitive ops, one module per op family (as in
//! `ramus_core::ops`), and [`run`], the one exhaustive match from an
//! [`Op`] to its kernel: adding a variant to the op set makes the compiler
//! point here. Kernels are written once for every [`Real`] type (`f32` for
//! speed, `f64` for gradient checks).

mod cnn;
mod ctx;
mod elementwise;
mod loss;
mod matmul;
mod packed;
mod row_matrix;
mod structure;

pub use cnn::update_running_stats;
pub use ctx::{Arg, ArgData, KernelCtx, NormSum};
pub use packed::{gemm_packed, PackedB};

use ramus_core::ops::Op;
use ramus_core::real::Real;
use ramus_core::Result;

use ctx::Kernel;

/// Runs `op`'s CPU kernel on `ctx`: writes the op's output into `ctx.out`
/// from `ctx.args`, or says what is wrong with them.
pub fn run<T: Real>(op: &Op, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
    match op {
        Op::Neg(o) => o.run(ctx),
        Op::Exp(o) => o.run(ctx),
        Op::Log(o) => o.run(ctx),
        Op::Sigmoid(o) => o.run(ctx),
        Op::Tanh(o) => o.run(ctx),
        Op::Relu(o) => o.run(ctx),
        Op::Scale(o) => o.run(ctx),
        Op::AddScalar(o) => o.run(ctx),
        Op::RsubScalar(o) => o.run(ctx),
        Op::Add(o) => o.run(ctx),
        Op::Sub(o) => o.run(ctx),
        Op::Mul(o) => o.run(ctx),
        Op::Div(o) => o.run(ctx),
        Op::SigmoidBackward(o) => o.run(ctx),
        Op::TanhBackward(o) => o.run(ctx),
        Op::ReluBackward(o) => o.run(ctx),
        Op::MatMul(o) => o.run(ctx),
        Op::RowMatMul(o) => o.run(ctx),
        Op::Concat(o) => o.run(ctx),
        Op::Slice(o) => o.run(ctx),
        Op::Pad(o) => o.run(ctx),
        Op::SumChildren(o) => o.run(ctx),
        Op::ExpandChildren(o) => o.run(ctx),
        Op::SumRows(o) => o.run(ctx),
        Op::BroadcastRows(o) => o.run(ctx),
        Op::Reshape(o) => o.run(ctx),
        Op::Embedding(o) => o.run(ctx),
        Op::EmbeddingUnk(o) => o.run(ctx),
        Op::EmbeddingUnkBackward(o) => o.run(ctx),
        Op::SoftmaxXent(o) => o.run(ctx),
        Op::SoftmaxXentBackward(o) => o.run(ctx),
        Op::Conv2d(o) => o.run(ctx),
        Op::Conv2dBackwardInput(o) => o.run(ctx),
        Op::Conv2dBackwardWeight(o) => o.run(ctx),
        Op::MaxPool2d(o) => o.run(ctx),
        Op::MaxPool2dBackward(o) => o.run(ctx),
        Op::GlobalAvgPool(o) => o.run(ctx),
        Op::GlobalAvgPoolBackward(o) => o.run(ctx),
        Op::ChannelSum(o) => o.run(ctx),
        Op::ChannelBroadcast(o) => o.run(ctx),
        Op::BatchNorm(o) => o.run(ctx),
        Op::BatchNormBackwardInput(o) => o.run(ctx),
        Op::BatchNormBackwardGamma(o) => o.run(ctx),
        Op::BatchNormInference(o) => o.run(ctx),
        Op::BatchNormInferenceBackwardInput(o) => o.run(ctx),
        Op::BatchNormInferenceBackwardParam(o) => o.run(ctx),
    }
}
