//! Ramus on the CPU: the batched engine (Cavs' scheduling, dynamic tensors
//! and lazy batching) that every other engine is checked against.

pub mod cell_eval;
pub mod compiled;
mod contract;
pub mod engine;
pub mod fused;
mod infer;
pub mod kernels;
pub mod parallel;
pub mod trace;

pub use contract::CpuTrainer;
pub use engine::CpuEngine;
pub use trace::training_trace;
