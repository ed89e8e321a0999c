//! Ramus models and training: the model zoo (dynamic models and CNNs), optimizers, checkpoints and
//! the training / evaluation loops.

pub mod atomic;
pub mod checkpoint;
pub mod engine;
pub mod error;
pub mod memory;
pub mod models;
pub mod nonfinite;
pub mod optim;
pub mod resume;
pub mod sequence_models;
pub mod train;
pub mod vision;

pub use engine::{step_outcome, Engine, StepOutcome};
pub use error::{NnError, Result, Setting};
pub use models::{
    build_model, build_model_with, build_mvrnn, data_kind, DataKind, ModelConfig, ModelOptions,
    MODEL_NAMES, MVRNN_MATRIX_WORDS,
};
pub use nonfinite::{NonFiniteFault, NonFiniteParam, NonFiniteStep, OnNonFinite, TensorPart};
pub use optim::{Optimizer, OptimizerConfig, OptimizerKind};
pub use sequence_models::{
    build_sequence_model, is_sequence_model, SequenceConfig, SEQUENCE_MODELS,
};
pub use train::{evaluate, EvalResult, Trainer};
pub use vision::{build_vision_model, ImageShape, VisionConfig};
