//! Ramus models and training: the model zoo (dynamic models and CNNs), checkpoints, resumable
//! runs and the training / evaluation loops. The engine contract, optimizers, errors and memory
//! estimates they use are `ramus-exec`'s.

mod blocks;
pub mod checkpoint;
pub mod models;
pub mod resume;
pub mod schedule;
pub mod sequence_models;
pub mod train;
pub mod vision;

pub use models::{
    build_model, build_model_with, build_mvrnn, data_kind, DataKind, ModelConfig, ModelOptions,
    MODEL_NAMES, MVRNN_MATRIX_WORDS,
};
pub use sequence_models::{
    build_sequence_model, is_sequence_model, SequenceConfig, SEQUENCE_MODELS,
};
pub use train::{evaluate, EvalResult, Trainer};
pub use vision::{build_vision_model, ImageShape, VisionConfig};

/// The README's library example, compiled and run as a doc test
/// (`cargo test --release -p ramus-nn --doc`); its other code blocks are
/// marked `sh`, `text` or `toml`, which rustdoc leaves alone.
#[doc = include_str!("../../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
