//! Errors of the model, training and checkpoint layer.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum NnError {
    #[error(transparent)]
    Core(#[from] ramus_core::CoreError),
    #[error(transparent)]
    Graph(#[from] ramus_graph::GraphError),
    #[error(transparent)]
    Engine(#[from] ramus_cpu::EngineError),
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
}

pub type Result<T, E = NnError> = std::result::Result<T, E>;
