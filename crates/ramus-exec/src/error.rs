//! The one error type of engines and training: engines return it, and the
//! training crate (`ramus-nn`) reuses it for its models, trainer and
//! checkpoints, so an engine's error reaches the command unchanged.

use std::path::PathBuf;

/// Why running or training a model failed.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error(transparent)]
    Core(#[from] ramus_core::CoreError),
    #[error(transparent)]
    Graph(#[from] ramus_graph::GraphError),
    /// Inconsistent inputs for this model and batch.
    #[error("bad input: {0}")]
    Input(String),
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    #[error("cannot access {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Config(String),
    /// A device engine (CUDA) failed; the message names the call or input.
    #[error("device: {0}")]
    Device(String),
    /// A training step whose loss or a gradient was not finite (see
    /// [`crate::nonfinite`]).
    #[error("{0}")]
    NonFinite(Box<crate::nonfinite::NonFiniteFault>),
    /// A hyper-parameter no one can mean (a negative learning rate, a clip
    /// threshold of 0, ...), refused before any work.
    #[error("{setting} must be {expected}, got {value}")]
    InvalidSetting {
        setting: Setting,
        value: f64,
        expected: &'static str,
    },
}

/// A checked hyper-parameter, displayed with its `ramus train` flag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Setting {
    LearningRate,
    WeightDecay,
    Clip,
    Beta1,
    Beta2,
    Eps,
    Dropout,
}

impl std::fmt::Display for Setting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Setting::LearningRate => "the learning rate (--lr)",
            Setting::WeightDecay => "the weight decay (--weight-decay)",
            Setting::Clip => "the gradient clipping norm (--clip)",
            Setting::Beta1 => "Adam's beta1",
            Setting::Beta2 => "Adam's beta2",
            Setting::Eps => "the optimizer's eps",
            Setting::Dropout => "the dropout rate (--dropout)",
        })
    }
}

impl ExecError {
    /// The non-finite step this error reports, if it is one.
    pub fn nonfinite(&self) -> Option<&crate::nonfinite::NonFiniteFault> {
        match self {
            ExecError::NonFinite(f) => Some(f),
            _ => None,
        }
    }
}

impl From<crate::nonfinite::NonFiniteStep> for ExecError {
    fn from(step: crate::nonfinite::NonFiniteStep) -> Self {
        ExecError::NonFinite(Box::new(crate::nonfinite::NonFiniteFault {
            step,
            place: None,
        }))
    }
}

pub type Result<T, E = ExecError> = std::result::Result<T, E>;
