//! Synthetic training traces with realistic sizes and op times.
//!
//! These stand in for engine-recorded traces in tests, examples and
//! benchmarks of the planner:
//!
//! * [`CnnSpec`]: CNN training — forward through a layer list, loss,
//!   backward in reverse, then the optimizer — with activation sizes derived
//!   from layer shapes. Presets: [`vgg16`], [`vgg19`], [`alexnet`],
//!   [`resnet`] (bottleneck blocks, configurable depth). Convolutions fuse
//!   bias (or batch norm) and ReLU; their backward is three ops (ReLU mask
//!   in place, filter gradient, data gradient) as cuDNN runs it.
//! * [`LstmSpec`]: an LSTM over one long sequence (a batch of them), with
//!   the head on the last state.
//! * [`TreeSpec`]: a child-sum Tree-LSTM over a batch of large random
//!   binary trees, one batched op per tree level as Cavs batches them.
//!
//! Op durations come from a roofline model ([`DeviceSpeed`]): the larger of
//! FLOPs over compute throughput and bytes touched over memory bandwidth,
//! plus a launch cost.

mod cnn;
mod lstm;
mod recorder;
#[cfg(test)]
mod tests;
mod tree;

pub use cnn::{alexnet, resnet, vgg16, vgg19, CnnLayer, CnnSpec};
pub use lstm::LstmSpec;
pub use recorder::{DeviceSpeed, Optimizer};
pub use tree::TreeSpec;
