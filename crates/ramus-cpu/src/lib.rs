//! Ramus on the CPU: the batched engine (Cavs' scheduling, dynamic tensors
//! and lazy batching) that every other engine is checked against.

pub mod compiled;
pub mod engine;
pub mod error;
pub mod trace;

pub use engine::{fill_dropout_mask, pulled_values, Batch, CpuEngine, ForwardOutput, Mode, Range};
pub use error::{EngineError, Result};
pub use trace::training_trace;
