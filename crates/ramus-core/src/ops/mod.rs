//! The built-in primitive ops (their builder methods are in
//! [`builder_ops`](crate::builder_ops), their registry table in
//! [`registry`](crate::registry)).

pub mod cnn;
pub mod elementwise;
pub mod loss;
pub mod matmul;
pub mod row_matrix;
mod set;
pub mod structure;

pub use cnn::{
    BatchNorm, BatchNormBackwardGamma, BatchNormBackwardInput, BatchNormInference,
    BatchNormInferenceBackwardInput, BatchNormInferenceBackwardParam, ChannelBroadcast, ChannelSum,
    Conv2d, Conv2dBackwardInput, Conv2dBackwardWeight, Conv2dGeom, GlobalAvgPool,
    GlobalAvgPoolBackward, MaxPool2d, MaxPool2dBackward, NormGeom, NormParam, Pool2dGeom,
    RUNNING_STATS_MOMENTUM,
};
pub use elementwise::*;
pub use loss::{SoftmaxXent, SoftmaxXentBackward};
pub use matmul::MatMul;
pub use row_matrix::RowMatMul;
pub use set::Op;
pub use structure::*;
